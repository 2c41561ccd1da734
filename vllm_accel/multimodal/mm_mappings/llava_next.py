"""LlavaNext (Granite Vision) on FMS: SigLIP tower + projector + Granite.

Anyres: an image becomes a base tile (the image resized to one tile) plus
the tiles of its best-fitting grid pinpoint; each tile gives
(image_size / patch_size)^2 features, the concatenation of several SigLIP
hidden layers, projected to the text width. Packing drops the letterbox
padding rows/columns and ends each feature row with ``image_newline``.
All of that is FMS's own ``get_image_features`` / ``pack_image_features``;
this class only feeds them one image at a time (per-image lengths) with the
patches vLLM padded on removed, the tiles of several images in one call.

SigLIP attends through ``span_attention`` (our kernel on the CPU with
AVX-512). Compiled: the SigLIP tower (``vision_module``) gets its input padded with
zero tiles to the image's tile-count bucket; it treats tiles independently
(attention stays within a tile), so padding does not change the real ones.
Its encoder layers run under torch.compile, all layers sharing one graph per
bucket (like the text layers: compile time independent of depth). Patch
embedding, pooling head, projector and packing stay eager: single ops or
small, and the latter two have image-dependent shapes.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from vllm_accel.buckets import thin_buckets
from vllm_accel.kernels import span_attention
from vllm_accel.multimodal.mm_mappings.base import VisionAdapter

DEFAULT_VISION_BUCKETS = 3


class LlavaNextVisionAdapter(VisionAdapter):
    vision_bucket_axis = (("hidden_states", 0),)  # SigLIP layers' [tiles, patches, hidden]

    def __init__(self, model_config, fms_model: nn.Module):
        super().__init__(model_config, fms_model)
        # SigLIP's layers attend by our op: the CPU kernel with AVX-512, FMS's
        # SDPA otherwise. FMS's get_image_features passes no attention
        # arguments, so the tower itself is given the name.
        tower = fms_model.vision_tower
        tower.forward = functools.partial(
            tower.forward, attn_name=span_attention.register_fms_attention())

    @property
    def vision_module(self) -> nn.Module:
        return self.fms_model.vision_tower

    def vision_compile_units(self) -> list[nn.Module]:
        return list(self.fms_model.vision_tower.base_model.encoder.layers)

    def _tile(self) -> int:
        return self.fms_model.config.vision_config.image_size

    def num_patches(self, image_size: torch.Tensor) -> int:
        """Tiles (base + grid) FMS encodes for an image of (height, width)."""
        config = self.fms_model.config
        return self.fms_model.image_size_to_num_patches(
            image_size, config.image_grid_pinpoints, self._tile())

    def vision_buckets(self) -> list[int]:
        # Tile counts the grid pinpoints give (base tile + grid), at most
        # DEFAULT_VISION_BUCKETS of them: each is a graph to compile at
        # start-up; an image between two kept counts pads up to the next.
        tile = self._tile()
        counts = [1 + math.ceil(h / tile) * math.ceil(w / tile)
                  for h, w in self.fms_model.config.image_grid_pinpoints]
        return thin_buckets(counts, DEFAULT_VISION_BUCKETS)

    def warmup_image_sizes(self, buckets: list[int]) -> list[tuple[int, int]]:
        # An image exactly the size of a pinpoint picks that pinpoint: together
        # they need every tile count, so they hit every bucket.
        by_bucket: dict[int, tuple[int, int]] = {}
        for h, w in self.fms_model.config.image_grid_pinpoints:
            by_bucket.setdefault(self.num_patches(torch.tensor([h, w])), (w, h))
        return [by_bucket[b] for b in sorted(by_bucket)]

    def vision_rows(self, item: dict[str, torch.Tensor]) -> int:
        return self.num_patches(item["image_sizes"].reshape(2).cpu())

    def encode_items(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        # vLLM pads the pixel_values of images processed together to the most
        # tiles among them; FMS wants a 4-D input of the real tiles only.
        tiles = []
        for item in items:
            count, pixel_values = self.vision_rows(item), item["pixel_values"]
            if pixel_values.dim() != 4 or pixel_values.shape[0] < count:
                raise ValueError(f"image of size {item['image_sizes'].tolist()} needs {count} "
                                 f"tiles, got pixel_values of shape {tuple(pixel_values.shape)}")
            tiles.append(pixel_values[:count])
        sizes = torch.stack([item["image_sizes"].reshape(2).cpu() for item in items])
        model = self.fms_model
        features = model.get_image_features(torch.cat(tiles).to(self.device), sizes)
        return [model.pack_image_features([f], sizes[i:i + 1], image_newline=model.image_newline)
                for i, f in enumerate(features)]
