"""Molmo on our FMS port (vllm_accel/model/molmo.py): Qwen2/OLMo decoder fed
with embeddings, vision backbone over image crops.

An image arrives from vLLM as its crops (vLLM's Molmo fields, flat per image:
``images`` [crops, patches, pixels], ``image_masks`` [crops, patches],
``image_input_idx`` [crops, pooled cells], ``num_crops``): a global crop plus
one per tile of the tiling vLLM selected. Its placeholder range holds
``<im_start>``, ``<im_patch>``, ``<im_col>`` and ``<im_end>`` tokens; only the
``<im_patch>`` positions are embeddings (``PlaceholderRange.is_embed``), and
``encode_items`` returns exactly those rows per image, in prompt order
(``image_input_idx``); the crops of several images go through one call.

Vision buckets count crops (2 .. max_crops + 1: at least one tile plus the
global crop). The backbone treats crops independently, so the shared
encoder's zero padding crops (images *and* masks: ``vision_padded_args``)
change no real crop's rows and are sliced off. The ViT blocks are compiled,
all sharing one graph per bucket; pooling and projector stay eager.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_accel.model.molmo import image_embed_order
from vllm_accel.multimodal.inputs import warmup_image
from vllm_accel.multimodal.mm_mappings.base import VisionAdapter

IMAGE_PATCH_TOKEN = "<im_patch>"


class MolmoVisionAdapter(VisionAdapter):
    vision_padded_args = 2  # backbone(images, image_masks): both have crops first
    vision_bucket_axis = (("x", 0),)  # ViT blocks' [crops, patches, hidden]

    def __init__(self, model_config, fms_model: nn.Module):
        super().__init__(model_config, fms_model)
        self._processor = None

    @classmethod
    def image_token_id(cls, model_config) -> int | None:
        """``<im_patch>``: the token at every embedding position of an image
        (Molmo's config does not name it; its tokenizer does). The tokenizer
        is the one vLLM serves with, under the user's --trust-remote-code."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            model_config.tokenizer, revision=model_config.tokenizer_revision,
            trust_remote_code=model_config.trust_remote_code)
        token_id = tokenizer.convert_tokens_to_ids(IMAGE_PATCH_TOKEN)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(f"Molmo tokenizer has no {IMAGE_PATCH_TOKEN} token")
        return int(token_id)

    @property
    def vision_module(self) -> nn.Module:
        return self.fms_model.vision

    def vision_compile_units(self) -> list[nn.Module]:
        return list(self.fms_model.vision.image_vit.transformer.resblocks)

    def vision_rows(self, item: dict[str, torch.Tensor]) -> int:
        return int(item["num_crops"]) if "num_crops" in item else item["images"].shape[0]

    def encode_items(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        for item in items:
            images, masks, idx = item["images"], item.get("image_masks"), item["image_input_idx"]
            if masks is None:
                raise ValueError("Molmo: image_masks are required (image_padding_mask=True)")
            crops = self.vision_rows(item)
            if not (images.shape[0] == masks.shape[0] == idx.shape[0] == crops):
                raise ValueError(f"Molmo image with {crops} crops got images "
                                 f"{tuple(images.shape)}, image_masks {tuple(masks.shape)}, "
                                 f"image_input_idx {tuple(idx.shape)}")
        features = self.vision_module(torch.cat([it["images"] for it in items]).to(self.device),
                                      torch.cat([it["image_masks"] for it in items]).to(self.device))
        outputs = []
        for item, crops in zip(items, features.split([self.vision_rows(it) for it in items])):
            crops = crops.reshape(-1, crops.shape[-1])
            outputs.append(crops[image_embed_order(item["image_input_idx"]).to(crops.device)])
        return outputs

    # ---- buckets and warmup ----------------------------------------------

    @property
    def processor(self):
        if self._processor is None:
            from transformers import AutoProcessor

            self._processor = AutoProcessor.from_pretrained(
                self.model_dir, trust_remote_code=self.trust_remote_code, local_files_only=True)
        return self._processor

    def vision_buckets(self) -> list[int]:
        max_crops = self.processor.image_processor.max_crops
        return list(range(2, max_crops + 2))

    def warmup_image_sizes(self, buckets: list[int]) -> list[tuple[int, int]]:
        """Per bucket b an image exactly b - 1 crop windows wide and one high
        (plus the overlap margins): vLLM's tiling choice for it is 1 x (b - 1)."""
        from vllm.model_executor.models.molmo import select_tiling

        ip = self.processor.image_processor
        base = ip.base_image_input_size
        base = base[0] if isinstance(base, (list, tuple)) else base
        left, right = ip.overlap_margins
        margin = (left + right) * ip.image_patch_size
        window = base - margin
        sizes = []
        for bucket in buckets:
            tiles = min(max(bucket - 1, 1), ip.max_crops)
            width, height = tiles * window + margin, window + margin
            tiling = select_tiling(height=height - margin, width=width - margin,
                                   patch_size=window, max_num_patches=ip.max_crops)
            if int(tiling[0]) * int(tiling[1]) != tiles:
                raise RuntimeError(f"warmup image {width}x{height} gives tiling {tiling}")
            sizes.append((width, height))
        return sizes

    def warmup_items(self, image_sizes):
        items = []
        for seed, (width, height) in enumerate(image_sizes):
            out = self.processor.process("", [warmup_image(width, height, seed)])
            items.append({"images": out["images"], "image_masks": out["image_masks"],
                          "image_input_idx": out["image_input_idx"],
                          "num_crops": torch.tensor(out["images"].shape[0])})
        return items
