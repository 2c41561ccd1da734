"""The contract between the model runner and one multimodal architecture.

The runner treats a multimodal FMS model as: a text model it drives exactly
like a text-only one (``text_model``: an FMS Granite/LLaMA whose ``base_model``
runs the decoder layers and ``head`` the LM head), plus three calls per step:

1. ``encode(items)``: the images scheduled this step (one dict of tensors per
   image, see ``item_tensors``) -> per image its embeddings, one row per
   embedding position of its vLLM ``PlaceholderRange`` (``get_num_embeds()``;
   all of ``length`` when ``is_embed`` is None), in placeholder order;
2. ``embed_tokens(ids)``: raw text embeddings (no model multipliers, as HF
   builds ``inputs_embeds`` before merging);
3. ``merge(embeds, mm_embeds, is_mm)``: image rows into the text embeddings.

The text model is then fed the merged embeddings instead of token ids.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils import _pytree as pytree

from vllm_accel.model.compile import compile_shared_forward
from vllm_accel.worker.buckets import find_bucket

logger = logging.getLogger(f"vllm.{__name__}")


def warmup_image(width: int, height: int, seed: int = 0):
    """A deterministic RGB noise image (PIL) of width x height pixels."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


class MultiModalUtils(ABC):
    is_multimodal = True

    def __init__(self, hf_config: Any, fms_model: nn.Module):
        self.hf_config = hf_config
        self.fms_model = fms_model
        self.encode_calls = 0  # images encoded so far (tests, stats)
        self.encoder_buckets: list[int] | None = None  # set by compile_encoder

    # ---- text side ------------------------------------------------------

    @classmethod
    def image_token_id(cls, hf_config: Any) -> int | None:
        """The token every image placeholder position holds in the prompt (the
        front end checks that the text itself adds none)."""
        for name in ("image_token_index", "image_token_id"):
            if getattr(hf_config, name, None) is not None:
                return int(getattr(hf_config, name))
        return None

    @classmethod
    def text_config(cls, hf_config: Any) -> Any:
        """The HF text sub-config (layers, kv heads, head dim for the KV spec)."""
        return hf_config.get_text_config()

    @property
    @abstractmethod
    def text_model(self) -> nn.Module:
        """The FMS language model (``.base_model`` decoder, ``.head`` LM head)."""

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[1, T] ids -> [1, T, hidden] raw embeddings (FMS multiplies later)."""
        return self.text_model.base_model.embedding(input_ids)

    def merge(self, inputs_embeds: torch.Tensor, mm_embeds: torch.Tensor,
              is_mm: torch.Tensor) -> torch.Tensor:
        """Scatter mm_embeds [N, hidden] at the N positions where is_mm [T] is set."""
        count = int(is_mm.sum())
        if count != mm_embeds.shape[0]:
            raise ValueError(f"{count} placeholder positions but {mm_embeds.shape[0]} "
                             "multimodal embeddings")
        merged = inputs_embeds.clone()
        merged[0, is_mm.to(merged.device)] = mm_embeds.to(merged.device, merged.dtype)
        return merged

    # ---- vision side ----------------------------------------------------

    @staticmethod
    def item_tensors(feature_data: Any) -> dict[str, torch.Tensor]:
        """One image's tensors from ``MultiModalFeatureSpec.data`` (a
        ``MultiModalKwargsItem``: key -> ``MultiModalFieldElem``).

        vLLM's GPU runner batches items with ``group_and_batch_mm_kwargs``,
        which reduces each key's ``elem.data`` across items with its field
        (stack for batched fields, concat for flat ones). For a single item
        that input, ``elem.data``, is the per-item tensor itself: e.g. for
        LlavaNext ``pixel_values`` [patches, 3, H, W] and ``image_sizes`` [2].
        """
        if feature_data is None:
            raise ValueError("multimodal item has no data (already encoded and cached, "
                             "or covered by the prefix cache): nothing to encode")
        tensors = {}
        for key, elem in feature_data.items():
            if not isinstance(elem.data, torch.Tensor):
                raise TypeError(f"multimodal field {key!r} holds {type(elem.data).__name__}, "
                                "not a tensor")
            tensors[key] = elem.data
        return tensors

    @torch.inference_mode()
    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Per image: its embeddings [num_embeds, hidden], in item order."""
        outputs = []
        for item in items:
            outputs.append(self.encode_item(item))
            self.encode_calls += 1
        return outputs

    @abstractmethod
    def encode_item(self, item: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's embeddings [num_embeds, hidden]."""

    @property
    @abstractmethod
    def vision_module(self) -> nn.Module:
        """The module ``compile_encoder`` pads. Its forward's first argument and
        every tensor it returns share a leading axis whose rows are computed
        independently (so zero rows can pad it to a bucket)."""

    def vision_compile_units(self) -> list[nn.Module]:
        """Modules of one class that run under torch.compile (default: the whole
        ``vision_module``). Identical encoder layers share one graph per shape,
        so compile time does not grow with depth."""
        return [self.vision_module]

    @abstractmethod
    def vision_buckets(self) -> list[int]:
        """Sizes of that leading axis one image can need (sorted)."""

    @abstractmethod
    def warmup_image_sizes(self) -> list[tuple[int, int]]:
        """(width, height) of images that together hit every vision bucket."""

    def compile_encoder(self, backend: str, buckets: list[int] | None = None) -> None:
        """Compile ``vision_compile_units`` with static shapes and zero-pad the
        input of ``vision_module`` to the smallest bucket that fits (outputs
        sliced back): one graph per bucket. ``buckets`` defaults to
        ``vision_buckets()``; coarser lists mean fewer graphs, more padding."""
        if self.encoder_buckets is not None:
            raise RuntimeError("compile_encoder was already called")
        module = self.vision_module
        self.encoder_buckets = sorted(set(buckets or self.vision_buckets()))
        compile_shared_forward(self.vision_compile_units(), backend, len(self.encoder_buckets))
        inner = module.forward

        def padded_forward(x: torch.Tensor, *args, **kwargs):
            rows = x.shape[0]
            bucket = find_bucket(self.encoder_buckets, rows)
            if bucket is None:
                logger.warning("vllm_accel: %d vision rows exceed every vision bucket %s; "
                               "compiling a graph for them", rows, self.encoder_buckets)
                bucket = rows
            if bucket > rows:
                x = torch.cat([x, x.new_zeros(bucket - rows, *x.shape[1:])])
            out = inner(x, *args, **kwargs)
            return pytree.tree_map_only(torch.Tensor, lambda t: t[:rows], out)

        module.forward = padded_forward

    def warmup_items(self, processor_dir: str,
                     image_sizes: list[tuple[int, int]]) -> list[dict[str, torch.Tensor]]:
        """Real images of the given (width, height) sizes through the model's own
        HF processor, one item per image in the form ``encode`` takes. The default
        suits processors whose outputs are batched per image (vLLM's
        ``MultiModalFieldConfig.batched``); flat layouts override this."""
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(processor_dir, local_files_only=True)
        items = []
        for seed, (width, height) in enumerate(image_sizes):
            out = processor.image_processor(images=[warmup_image(width, height, seed)],
                                            return_tensors="pt")
            items.append({k: v[0] for k, v in out.items() if isinstance(v, torch.Tensor)})
        return items

    @property
    def device(self) -> torch.device:
        return next(self.fms_model.parameters()).device
