"""Qwen2.5-VL on our FMS port (vllm_accel/model/qwen2_5_vl.py).

An image arrives from vLLM as its flat patches (``pixel_values`` [patches,
3 * 2 * 14 * 14], any image size the processor accepts: no 112-pixel rule)
and its grid (``image_grid_thw`` [3]: frames, patch rows, patch columns). The
vision tower turns every 2x2 patches into one token; the prompt holds that
many ``<|image_pad|>`` tokens.

Vision buckets count patches (vllm-gaudi's ``VLLM_MULTIMODAL_BUCKETS``
meaning). The tower masks padding patches out of attention and the merger,
so padding an image up to its bucket changes none of its tokens; images
packed into one call stay apart the same way. Defaults:
powers of two from the processor's smallest image (min_pixels) to its largest
(max_pixels). The text model takes 3-D (M-RoPE) positions.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from vllm_accel.buckets import exponential_buckets
from vllm_accel.model.qwen2_5_vl import mrope_positions
from vllm_accel.multimodal.mm_mappings.base import VisionAdapter


class Qwen2_5_VLVisionAdapter(VisionAdapter):
    uses_3d_positions = True
    # Window and full-attention blocks (their masks differ in shape); one
    # graph serves both where our kernel attends by spans.
    vision_graphs_per_bucket = 2
    # Blocks' x, rotary tables and spans have the patches first; the masks
    # are not read on the cpu (the kernel attends by spans).
    vision_bucket_axis = (("x", 0), ("cos", 0), ("sin", 0), ("ranges", 0))
    vision_padding_rows_last = True  # patches in window order, then the padding
    unsupported_modalities = ("video",)

    def __init__(self, model_config, fms_model: nn.Module):
        super().__init__(model_config, fms_model)
        merge = self.hf_config.vision_config.spatial_merge_size
        self.vision_bucket_multiple = merge * merge  # patches merged into one token

    @property
    def vision_module(self) -> nn.Module:
        return self.fms_model.visual

    def vision_compile_units(self) -> list[nn.Module]:
        return list(self.fms_model.visual.layers)

    def vision_rows(self, item: dict[str, torch.Tensor]) -> int:
        return int(item["image_grid_thw"].prod())

    def encode_items(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        for item in items:
            patches, grid = item["pixel_values"], item["image_grid_thw"].reshape(3)
            if patches.shape[0] != self.vision_rows(item):
                raise ValueError(f"image grid {grid.tolist()} needs {self.vision_rows(item)} "
                                 f"patches, got pixel_values of shape {tuple(patches.shape)}")
        grids = torch.stack([item["image_grid_thw"].reshape(3) for item in items])
        patches = torch.cat([item["pixel_values"] for item in items]).to(self.device)
        tokens = self.vision_module(patches, grids)  # every image's tokens, in item order
        return list(tokens.split([self.vision_rows(it) // self.vision_bucket_multiple
                                  for it in items]))

    def vision_batch_rows(self, buckets: list[int]) -> int:
        # Window blocks attend in bands (work linear in a call's rows), but
        # full-attention blocks over the whole call (masks keep images apart):
        # their work grows with the square of its rows. Pack up to the rows
        # where such a block's attention costs as much as its linear layers:
        # per row 4 * rows * width against 2 * (4 * width**2 + 3 * width * mlp)
        # multiply-adds. (The CPU kernel with AVX-512 attends within each
        # frame's rows, so there the limit is conservative.)
        config = self.fms_model.visual.config
        return int(2 * config.emb_dim + 1.5 * config.hidden_dim)

    def rope_positions(self, prompt_token_ids, items):
        config = self.hf_config
        positions, delta = mrope_positions(
            prompt_token_ids, [item["image_grid_thw"].tolist() for item in items],
            image_token_id=config.image_token_id,
            vision_start_token_id=config.vision_start_token_id,
            spatial_merge_size=config.vision_config.spatial_merge_size,
        )
        return positions.numpy().astype(np.int64), delta

    # ---- buckets and warmup ----------------------------------------------

    def _patch_limits(self) -> tuple[int, int]:
        """Patches of the smallest and the largest image the processor makes,
        the largest no more than a prompt of max_model_len tokens can hold
        (an image is a token per ``unit`` patches)."""
        processor = self.image_processor
        size, patch = processor.size, processor.patch_size
        unit = self.vision_bucket_multiple
        smallest = max(unit, size["shortest_edge"] // (patch * patch) // unit * unit)
        largest = min(size["longest_edge"] // (patch * patch), self.max_model_len * unit)
        return smallest, largest // unit * unit

    def vision_buckets(self) -> list[int]:
        return exponential_buckets(*self._patch_limits())

    def warmup_image_sizes(self, buckets: list[int]) -> list[tuple[int, int]]:
        """Per bucket an image the processor keeps as it is (sides multiples of
        28 pixels) whose patches fill most of it."""
        side = self.image_processor.patch_size * int(math.sqrt(self.vision_bucket_multiple))
        smallest, largest = self._patch_limits()
        sizes = []
        for bucket in buckets:
            tokens = max(smallest, min(bucket, largest)) // self.vision_bucket_multiple
            rows = max(1, math.isqrt(tokens))
            sizes.append((side * (tokens // rows), side * rows))
        return sizes

    def warmup_items(self, image_sizes):
        return [{"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"][0]}
                for out in self.processed_warmup_images(image_sizes)]
