"""Pixtral's vision tower (Mistral3's) over the flat patches of several
images, with FMS's own layers.

FMS's ``PixtralVisionModel`` embeds each image by a convolution and runs its
transformer over the patches of every image of a call as one sequence, each
patch attending to all of them (HF's class keeps images apart with a block
mask, so FMS equals it one image at a time only). Here FMS's weights and
blocks run over patch rows as the shared vision encoder pads them:

- the convolution (stride = kernel = patch size) as a linear layer over each
  patch's pixels, in the processor's row-major patch order;
- FMS's ``PixtralAttentionLayer`` blocks, their 2-D rotary from each patch's
  (row, column) in its image, attending through ``span_attention`` within
  the patch's own image (a padding row: a span of the padding rows);
- the blocks up to the config's ``vision_feature_layer`` (HF's
  ``hidden_states[layer]``: 0 is the patch embedding).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from vllm_accel.kernels import span_attention


def image_patches(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """[3, height, width] -> [(height // patch) * (width // patch), 3 * patch * patch]:
    the patches row by row, each as the convolution reads it (channel, row, column)."""
    channels, height, width = pixels.shape
    rows, cols = height // patch, width // patch
    pixels = pixels[:, :rows * patch, :cols * patch]
    return (pixels.reshape(channels, rows, patch, cols, patch).permute(1, 3, 0, 2, 4)
            .reshape(rows * cols, channels * patch * patch))


def patch_layout(grids: list[tuple[int, int]], total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per patch row of a call (images' patches in order, then padding up to
    ``total``): its (row, column) in its image [1, total, 2] int64, and the
    rows of its image as a span [first, last + 1) [1, total, 2] int32."""
    positions = np.zeros((total, 2), dtype=np.int64)
    spans = np.zeros((total, 2), dtype=np.int32)
    start = 0
    for rows, cols in grids:
        end = start + rows * cols
        positions[start:end, 0] = np.repeat(np.arange(rows), cols)
        positions[start:end, 1] = np.tile(np.arange(cols), rows)
        spans[start:end] = (start, end)
        start = end
    spans[start:] = (start, total)  # padding rows attend among themselves
    return torch.from_numpy(positions)[None], torch.from_numpy(spans)[None]


class PixtralPatches(nn.Module):
    """forward(patches [rows, 3 * patch**2], grids [images, 2] (patch rows
    and columns of each image, on the host)) -> [rows, hidden]: the features
    at ``vision_feature_layer`` of every patch row (padding rows included)."""

    def __init__(self, tower: nn.Module, feature_layer: int):
        super().__init__()
        conv = tower.patch_conv
        self.patch_size = conv.kernel_size[0]
        self.patch_embed = nn.Linear(conv.in_channels * self.patch_size ** 2,
                                     conv.out_channels, bias=False)
        self.patch_embed.weight = nn.Parameter(conv.weight.detach().reshape(
            conv.out_channels, -1), requires_grad=False)
        self.ln_pre = tower.ln_pre
        layers = tower.transformer.layers
        depth = feature_layer % (len(layers) + 1)  # HF's hidden_states index
        self.layers = nn.ModuleList(layers[:depth])
        self.attn_name = span_attention.register_fms_attention()

    def forward(self, patches: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        positions, ranges = patch_layout([tuple(g) for g in grids.tolist()], patches.shape[0])
        device = patches.device
        x = self.ln_pre(self.patch_embed(patches.to(self.patch_embed.weight.dtype)))[None]
        for layer in self.layers:
            x = layer(x, position_ids=positions.to(device), attn_name=self.attn_name,
                      ranges=ranges.to(device))
        return x[0]
