"""What one vision-language architecture must tell the runner: its vision adapter.

The runner drives a multimodal FMS model as a text model (``text_model``: an
FMS decoder whose ``base_model`` runs the layers and ``head`` the LM head) fed
with embeddings, plus the architecture's vision side:

- ``embed_tokens(ids)``: raw text embeddings (before model multipliers, as HF
  builds ``inputs_embeds`` before merging);
- ``encode_items(items)``: several images (their tensors from vLLM, see
  ``multimodal.inputs.item_tensors``) in one call of the vision module -> per
  image its embeddings, one row per embedding position of its vLLM
  ``PlaceholderRange`` (``get_num_embeds()``), in order; ``vision_rows(item)``
  says how many rows of the vision module's input one image takes;
- ``vision_module`` / ``vision_compile_units`` / ``vision_buckets``: what the
  shared machinery in ``multimodal/encoder.py`` pads to static shapes and
  compiles; ``vision_batch_rows``: how many rows it may pack into one call;
- ``warmup_image_sizes`` / ``warmup_items``: real images that hit every
  vision bucket;
- ``rope_positions``, for models with 3-D rotary positions (M-RoPE): each
  prompt's positions, computed from its images;
- ``layer_additions``, for models whose image rows also feed the decoder's
  first layers (Qwen3-VL's DeepStack): the rows are that many hidden widths
  wider, and so is every embedding the text model is fed;
- ``unsupported_modalities``: inputs the model's processor accepts but the
  architecture's port does not (their per-prompt limit is forced to 0).

Everything every architecture shares (compile, padding, counting, merging)
lives in ``multimodal/encoder.py``, not here.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch
from torch import nn

from vllm_accel.multimodal.inputs import processor_items


class VisionAdapter(ABC):
    # Vision buckets are rounded up to a multiple of this (rows that must stay
    # together, e.g. the 2x2 patches Qwen2.5-VL merges into one token).
    vision_bucket_multiple: int = 1
    # How many leading positional arguments of ``vision_module`` share the
    # padded leading axis (e.g. Molmo's crops and their masks): all are padded
    # with zero rows alike.
    vision_padded_args: int = 1
    # Whether every tensor inside ``vision_module`` with as many rows as its
    # padded input keeps the padding rows last (row-wise work may then skip
    # them: ForwardContext.live_rows). Not where rows are tiles or crops of patches.
    vision_padding_rows_last: bool = False
    # Graphs each vision bucket compiles: one, or one per kind of block whose
    # inputs differ in shape (Qwen2.5-VL's window and full-attention blocks).
    vision_graphs_per_bucket: int = 1
    # Where a compile unit's arguments carry the rows buckets pad, (argument
    # name, dimension) pairs, for one graph that serves every bucket
    # (settings.bucket_graphs); () where the rows shape more than that.
    vision_bucket_axis: tuple[tuple[str, int], ...] = ()
    # Whether the text model takes 3-D positions [3, 1, tokens] (see rope_positions).
    uses_3d_positions: bool = False
    # Embeddings added to the decoder's hidden states after its first layers
    # at multimodal positions: each row ``encode_items`` returns is the input
    # embedding followed by these (after layer 0, 1, ...), and the text model
    # takes embeddings of that width (``embedding_width``): text positions
    # carry zeros there, which change nothing.
    layer_additions: int = 0
    unsupported_modalities: tuple[str, ...] = ()

    def __init__(self, model_config: Any, fms_model: nn.Module):
        """``model_config``: vLLM's ModelConfig of the served model."""
        self.hf_config = model_config.hf_config
        self.fms_model = fms_model
        self.model_dir = model_config.model  # the checkpoint, with its processor files
        self.trust_remote_code = model_config.trust_remote_code  # the user's consent
        # A prompt never outgrows this, so neither does any image it holds.
        self.max_model_len = model_config.max_model_len

    # ---- text side ------------------------------------------------------

    @classmethod
    def image_token_id(cls, model_config: Any) -> int | None:
        """The token every image placeholder position holds in the prompt (the
        front end checks that the text itself adds none); ``model_config`` is
        vLLM's."""
        for name in ("image_token_index", "image_token_id"):
            if getattr(model_config.hf_config, name, None) is not None:
                return int(getattr(model_config.hf_config, name))
        return None

    @property
    def text_model(self) -> nn.Module:
        """The FMS language model (``.base_model`` decoder, ``.head`` LM head);
        our ports and FMS's LlavaNext all call it ``language_model``."""
        return self.fms_model.language_model

    def embedding_width(self, hidden_size: int) -> int:
        """The width of the embeddings the text model takes (and of each
        encoded multimodal row): the hidden size, times 1 + layer_additions."""
        return hidden_size * (1 + self.layer_additions)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[1, T] ids -> [1, T, embedding_width] raw embeddings (FMS
        multiplies later); zeros past the hidden size (layer_additions)."""
        embeds = self.text_model.base_model.embedding(input_ids)
        if self.layer_additions:
            embeds = torch.nn.functional.pad(embeds, (0, embeds.shape[-1] * self.layer_additions))
        return embeds

    def rope_positions(self, prompt_token_ids: list[int],
                       items: list[dict[str, torch.Tensor]]) -> tuple[np.ndarray, int]:
        """Only when ``uses_3d_positions``: a prompt's positions [3, prompt_len]
        given its images (in prompt order), and the offset ``delta`` that places
        every later token t at t + delta on all three axes."""
        raise NotImplementedError(f"{type(self).__name__} uses 1-D positions")

    # ---- vision side ----------------------------------------------------

    @abstractmethod
    def vision_rows(self, item: dict[str, torch.Tensor]) -> int:
        """Rows of ``vision_module``'s padded leading axis this image takes."""

    @abstractmethod
    def encode_items(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Per image its embeddings [num_embeds, hidden], from one call of
        ``vision_module`` on the images' rows concatenated in item order
        (through which the shared encoder pads and compiles)."""

    def encode_item(self, item: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's embeddings [num_embeds, hidden]."""
        return self.encode_items([item])[0]

    @property
    @abstractmethod
    def vision_module(self) -> nn.Module:
        """The module whose first input's leading axis is padded to a vision
        bucket (zero rows appended, also to the next ``vision_padded_args - 1``
        positional inputs; every tensor it returns is sliced back to the real
        rows). Padding rows must not change the real rows' outputs."""

    def vision_compile_units(self) -> list[nn.Module]:
        """Modules of one class that run under torch.compile (default: the whole
        ``vision_module``). Identical encoder layers share one graph per shape,
        so compile time does not grow with depth."""
        return [self.vision_module]

    @abstractmethod
    def vision_buckets(self) -> list[int]:
        """Sizes of that leading axis one image can need (sorted)."""

    def vision_batch_rows(self, buckets: list[int]) -> int:
        """Most rows one call may pack, several images together (the largest
        of ``buckets`` by default: rows of different images never meet, so a
        call's work grows with its rows and packing only saves calls). The
        encoder rounds it down to a bucket; with the default buckets, a
        budget past the largest image adds doublings of it."""
        return buckets[-1]

    @abstractmethod
    def warmup_image_sizes(self, buckets: list[int]) -> list[tuple[int, int]]:
        """(width, height) of images that together hit every one of ``buckets``."""

    @functools.cached_property
    def image_processor(self):
        """The checkpoint's own image processor (its size limits, warmup images)."""
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(self.model_dir, local_files_only=True)

    def processed_warmup_images(self, image_sizes: list[tuple[int, int]]) -> list[dict]:
        """One warmup image of each (width, height) through ``image_processor``
        (its outputs batched, one image each): for adapters whose items are
        the image processor's outputs reshaped."""
        from vllm_accel.multimodal.inputs import warmup_image

        return [self.image_processor(images=[warmup_image(width, height, seed)],
                                     return_tensors="pt")
                for seed, (width, height) in enumerate(image_sizes)]

    def warmup_items(self, image_sizes: list[tuple[int, int]]) -> list[dict[str, torch.Tensor]]:
        """Images of those sizes through the model's own processor, in the form
        ``encode_item`` takes. The default suits processors whose outputs are
        batched per image; flat layouts override this."""
        return processor_items(self.model_dir, image_sizes, self.trust_remote_code)

    @property
    def device(self) -> torch.device:
        return next(self.fms_model.parameters()).device
