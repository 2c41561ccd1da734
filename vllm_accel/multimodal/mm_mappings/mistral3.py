"""Mistral3 (Mistral-Small-3.1/3.2, Pixtral tower) on FMS's ``mistral3``.

An image arrives from vLLM as its pixels at the processor's size
(``pixel_values`` [3, height, width], both multiples of the patch size times
the merge size, the longest edge at most the processor's). vLLM's own
processor expands its ``[IMG]`` into rows of ``[IMG]`` closed by
``[IMG_BREAK]``, the last by ``[IMG_END]``; only the ``[IMG]`` positions take
embeddings (``PlaceholderRange.is_embed``), one per 2x2 merged patches.

Vision buckets count patches, as Qwen2.5-VL's: the tower
(``model/pixtral_vision.PixtralPatches``: FMS's blocks over flat patch rows)
keeps each image's patches among themselves, so padding and packing change no
image's features. FMS's projector (its norm, patch merger and MLP) then runs
on each image apart, eager: its shapes follow the image's grid.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from vllm_accel.buckets import exponential_buckets
from vllm_accel.model.pixtral_vision import PixtralPatches, image_patches
from vllm_accel.multimodal.mm_mappings.base import VisionAdapter


class Mistral3VisionAdapter(VisionAdapter):
    # FMS's blocks take [1, rows, hidden] and each row's 2-D position and
    # span (``ranges``, an attention keyword argument).
    vision_bucket_axis = (("hidden_states", 1), ("position_ids", 1), ("ranges", 1))

    def __init__(self, model_config, fms_model: nn.Module):
        super().__init__(model_config, fms_model)
        config = fms_model.config
        layer = config.vision_feature_layer
        if not isinstance(layer, int):
            raise ValueError(f"vllm-accel runs Mistral3 with one vision_feature_layer, not "
                             f"{layer!r}")
        self.patch_size = config.vision_config.patch_size
        self.merge = config.spatial_merge_size
        self.vision_bucket_multiple = self.merge * self.merge  # patches merged into one token
        self.tower = PixtralPatches(fms_model.vision_tower, layer)

    @property
    def vision_module(self) -> nn.Module:
        return self.tower

    def vision_compile_units(self) -> list[nn.Module]:
        return list(self.tower.layers)

    def _grid(self, item: dict[str, torch.Tensor]) -> tuple[int, int]:
        height, width = item["pixel_values"].shape[-2:]
        return height // self.patch_size, width // self.patch_size

    def vision_rows(self, item: dict[str, torch.Tensor]) -> int:
        rows, cols = self._grid(item)
        return rows * cols

    def encode_items(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        for item in items:
            if item["pixel_values"].dim() != 3:
                raise ValueError(f"a Mistral3 image's pixel_values are [3, height, width], "
                                 f"got {tuple(item['pixel_values'].shape)}")
        grids = [self._grid(item) for item in items]
        patches = torch.cat([image_patches(item["pixel_values"], self.patch_size)
                             for item in items]).to(self.device)
        features = self.tower(patches, torch.tensor(grids))
        projector = self.fms_model.multi_modal_projector
        out = []
        for image, (rows, cols) in zip(features.split([r * c for r, c in grids]), grids):
            size = [(rows * self.patch_size, cols * self.patch_size)]
            out.append(projector(image, size))
        return out

    # ---- buckets and warmup ----------------------------------------------

    def _longest_side(self) -> int:
        """Patches along the longest side the processor lets an image keep."""
        return self.image_processor.size["longest_edge"] // self.patch_size

    def vision_buckets(self) -> list[int]:
        # At most the largest image, and no more patches than a prompt of
        # max_model_len tokens can hold (a token per merged 2x2, and breaks).
        side = self._longest_side() // self.merge * self.merge
        unit = self.vision_bucket_multiple
        return exponential_buckets(unit, min(side * side, self.max_model_len * unit))

    def warmup_image_sizes(self, buckets: list[int]) -> list[tuple[int, int]]:
        """Per bucket an image the processor keeps as it is (sides multiples of
        the merged patch) whose patches fill most of it."""
        unit = self.patch_size * self.merge
        cells = self._longest_side() // self.merge  # merged patches a side may hold
        sizes = []
        for bucket in buckets:
            tokens = max(1, bucket // self.vision_bucket_multiple)
            rows = min(cells, max(1, math.isqrt(tokens)))
            cols = min(cells, tokens // rows)
            sizes.append((unit * cols, unit * rows))
        return sizes

    def warmup_items(self, image_sizes):
        # Cropped to the image's own size, as vLLM's Mistral3 processing does.
        return [{"pixel_values": out["pixel_values"][0, :, :rows, :cols]}
                for out in self.processed_warmup_images(image_sizes)
                for rows, cols in [out["image_sizes"][0].tolist()]]
