"""The vision tower of our Qwen3-VL port (vllm_accel/model/qwen3_vl.py), in
IBM foundation-model-stack (FMS) style.

Math as HF's Qwen3VLVisionModel: patches (3 channels x 2 frames x 16 x 16
pixels, flattened by the image processor, each image's 2x2 merge groups
consecutive) -> linear patch embedding (HF's Conv3d, its kernel its stride)
-> plus learned position embeddings, a square table resampled bilinearly
(corners aligned) to each image's patch grid -> blocks (LayerNorm, attention
with 2-D rotary over patch (row, column) within each frame, LayerNorm, GELU
MLP) -> merger (LayerNorm, 2x2 neighbouring patches concatenated, MLP).
After the blocks named in ``deepstack_indexes``, a DeepStack merger (2x2
concatenated, then LayerNorm, MLP) makes one more feature per image token;
the decoder adds them to its hidden states after its first layers.

The tower returns, per image token, the merger's row followed by each
DeepStack feature: [tokens, (1 + k) * out_dim], the wide embeddings our
decoder takes (``qwen2.split_layer_additions``).

Static shapes for torch.compile as the Qwen2.5-VL tower
(qwen2_5_vl_vision.py), without its windows: the caller may pad the patches
with rows up to a bucket size; everything that depends on the image grid
(rotary angles, attention spans, position-embedding taps) is computed
eagerly in ``vision_layout``, so one compiled block graph per bucket serves
every block. Padding rows form their own attention segment and their own
merged rows (pad counts are multiples of 4), dropped before returning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fms.utils.config import ModelConfig

from vllm_accel.model.qwen2_5_vl_vision import (
    PatchTowerShape,
    VisionAttention,
    axial_angles,
    row_spans,
)


@dataclass
class Qwen3VisionConfig(ModelConfig, PatchTowerShape):
    # Defaults: Qwen3-VL-4B's shapes.
    depth: int = 24
    emb_dim: int = 1024
    nheads: int = 16
    hidden_dim: int = 4096  # MLP inner size (HF intermediate_size)
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304  # a square table: 48 x 48
    deepstack_indexes: list[int] = field(default_factory=lambda: [5, 11, 17])
    out_dim: int = 2560  # = the text model's emb_dim
    norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    activation_fn: str = "gelu_pytorch_tanh"

    @property
    def grid_side(self) -> int:
        return int(self.num_position_embeddings**0.5)


_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
}


class VisionMLP(nn.Module):
    def __init__(self, config: Qwen3VisionConfig):
        super().__init__()
        if config.activation_fn not in _ACTIVATIONS:
            raise ValueError(f"Qwen3-VL vision: activation {config.activation_fn!r} is not "
                             f"supported ({', '.join(_ACTIVATIONS)})")
        self.fc1 = nn.Linear(config.emb_dim, config.hidden_dim)
        self.fc2 = nn.Linear(config.hidden_dim, config.emb_dim)
        self.act = _ACTIVATIONS[config.activation_fn]

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Qwen3VisionBlock(nn.Module):
    def __init__(self, config: Qwen3VisionConfig):
        super().__init__()
        self.ln = nn.LayerNorm(config.emb_dim, eps=config.norm_eps)
        self.attn = VisionAttention(config.emb_dim, config.nheads)
        self.ff_ln = nn.LayerNorm(config.emb_dim, eps=config.norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x, cos, sin, mask, ranges):
        """All inputs have the padded size: x [N, D], cos/sin [N, head_dim / 2],
        mask [N, N] (True = may attend), ranges [N, 2] (each row's frame as a
        span of rows). Dynamo-clean."""
        x = x + self.attn(self.ln(x), cos, sin, mask, ranges)
        return x + self.mlp(self.ff_ln(x))


class PatchMerger(nn.Module):
    """Each run of merge_size**2 consecutive rows (one 2x2 block of
    neighbouring patches) becomes one row, then a GELU MLP to the text
    model's width. LayerNorm before the merge (the main merger) or after it
    (``after``: the DeepStack mergers)."""

    def __init__(self, config: Qwen3VisionConfig, after: bool):
        super().__init__()
        merged = config.emb_dim * config.spatial_merge_size**2
        self.after = after
        self.ln = nn.LayerNorm(merged if after else config.emb_dim, eps=config.norm_eps)
        self.fc1 = nn.Linear(merged, merged)
        self.fc2 = nn.Linear(merged, config.out_dim)

    def forward(self, x):
        merged = self.fc1.in_features
        x = self.ln(x.reshape(-1, merged)) if self.after else self.ln(x).reshape(-1, merged)
        return self.fc2(F.gelu(self.fc1(x)))


@dataclass
class VisionLayout:
    """What the tower needs that depends on the image grid, for one padded
    size. Built eagerly outside compiled code."""

    # [N_padded, head_dim / 2] float32 rotary angles (padding: 0)
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor  # [N_padded, N_padded] bool: same frame
    ranges: torch.Tensor  # [N_padded, 2] int32: each row's frame as [first, last + 1)
    # Position embedding of each row: four table rows and their bilinear
    # weights [N_padded, 4] (padding: row 0, weight 0)
    pos_index: torch.Tensor
    pos_weight: torch.Tensor
    num_real: int  # patches before the padding


def _taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps (corners aligned) into a table of ``side`` entries for
    positions ``index`` on an axis of ``size`` patches: two table indices and
    their weights each, in HF's float32 arithmetic."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def vision_layout(config: Qwen3VisionConfig, grid_thw: Sequence[Sequence[int]],
                  num_padded: int, device: torch.device | str = "cpu") -> VisionLayout:
    """grid_thw: per image (frames t, patch rows h, patch columns w), as the
    image processor returns. num_padded: total patch rows including padding."""
    m = config.spatial_merge_size
    side = config.grid_side
    rows, cols, frames, taps, weights = [], [], [], [], []
    frames_done = 0
    for t, h, w in (tuple(int(v) for v in g) for g in grid_thw):
        # The processor's patch order: 2x2 merge blocks row-major, each block row-major.
        br, bc, ir, ic = torch.meshgrid(torch.arange(h // m), torch.arange(w // m),
                                        torch.arange(m), torch.arange(m), indexing="ij")
        r, c = (br * m + ir).flatten(), (bc * m + ic).flatten()
        rows.append(r.repeat(t))
        cols.append(c.repeat(t))
        frames.append(torch.arange(t).repeat_interleave(h * w) + frames_done)
        frames_done += t
        (h_taps, h_w), (w_taps, w_w) = _taps(r, h, side), _taps(c, w, side)
        taps.append((h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4).repeat(t, 1))
        weights.append((h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4).repeat(t, 1))
    num_real = sum(len(r) for r in rows)
    num_pad = num_padded - num_real
    unit = m * m
    if num_pad < 0 or num_pad % unit:
        raise ValueError(f"{num_padded} patch rows for {num_real} real patches: padding must be "
                         f"a non-negative multiple of {unit}")
    seg = torch.cat([*frames, torch.full((num_pad,), -1)])  # padding: one segment of its own
    angles = axial_angles(config.head_dim, config.rope_theta, torch.cat(rows), torch.cat(cols),
                          num_pad)
    return VisionLayout(
        cos=angles.cos().to(device),
        sin=angles.sin().to(device),
        mask=(seg[:, None] == seg[None, :]).to(device),
        ranges=row_spans(seg).to(device),
        pos_index=torch.cat([*taps, torch.zeros(num_pad, 4, dtype=torch.long)]).to(device),
        pos_weight=torch.cat([*weights, torch.zeros(num_pad, 4)]).to(device),
        num_real=num_real,
    )


class Qwen3VisionTransformer(nn.Module):
    def __init__(self, config: Qwen3VisionConfig):
        super().__init__()
        self.config = config
        # A Conv3d whose kernel equals its stride, on patches the processor
        # already flattened, is a linear layer over the flattened patch.
        self.patch_embed = nn.Linear(config.patch_dim, config.emb_dim)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.emb_dim)
        self.layers = nn.ModuleList(Qwen3VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config, after=False)
        self.deepstack_mergers = nn.ModuleList(
            PatchMerger(config, after=True) for _ in config.deepstack_indexes)

    def forward(self, pixel_values: torch.Tensor, grid_thw,
                layout: Optional[VisionLayout] = None) -> torch.Tensor:
        """pixel_values [N_padded, C*T*P*P] (real patches first, in the image
        processor's order, then any padding rows, a multiple of
        spatial_merge_size**2). grid_thw [images, 3]. Returns [N_real /
        merge**2, (1 + len(deepstack_indexes)) * out_dim]: per image token,
        its embedding and its DeepStack features, in prompt order."""
        if layout is None:
            layout = vision_layout(self.config, torch.as_tensor(grid_thw).tolist(),
                                   pixel_values.shape[0], pixel_values.device)
        x = self.patch_embed(pixel_values.to(self.pos_embed.weight.dtype))
        pos = (self.pos_embed(layout.pos_index) * layout.pos_weight[:, :, None]).sum(1)
        x = x + pos.to(x.dtype)
        deepstack = dict(zip(self.config.deepstack_indexes, self.deepstack_mergers))
        features = []
        for i, layer in enumerate(self.layers):
            x = layer(x, layout.cos, layout.sin, layout.mask, layout.ranges)
            if i in deepstack:
                features.append(deepstack[i](x))
        out = torch.cat([self.merger(x), *features], dim=-1)
        return out[: layout.num_real // self.config.spatial_merge_size**2]
