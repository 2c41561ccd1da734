"""The vision tower of our Qwen2.5-VL port (vllm_accel/model/qwen2_5_vl.py), in
IBM foundation-model-stack (FMS) style.

Math as HF's Qwen2_5_VisionTransformerPretrainedModel:
patches (3 channels x 2 frames x 14 x 14 pixels, flattened by the image
processor) -> linear patch embedding -> reorder so each attention window is
contiguous -> blocks (RMSNorm, attention with 2-D rotary over patch (row,
column), gated SiLU MLP) -> merger (RMSNorm, 2x2 neighbouring patches
concatenated, MLP) -> undo the window order. Most blocks attend within
windows of window_size pixels; blocks in fullatt_block_indexes attend over
the whole frame.

Static shapes for torch.compile: the caller may pad the patches with extra
rows up to a bucket size. Everything that depends on the image grid (window
order, rotary angles, attention masks) is computed eagerly outside the
blocks, in ``VisionLayout``; a block only sees tensors of the padded size, so
a compiled graph per bucket serves every block of a kind: window blocks
attend within a band of rows (``banded_attention``: work linear in the rows,
as a window's rows are consecutive), full-attention blocks over the whole
call under a mask (two graphs per bucket); on the CPU both kinds attend by
``span_attention`` (our kernel, or torch's SDPA per window or frame where the
kernel does not run the dtype), each row to its window's or frame's span of
rows. Padding rows form their own
attention segment (real patches never see them) and their own merged rows
(pad counts are multiples of 4), which are dropped before returning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fms.modules.feedforward import GatedLinearUnit
from fms.utils.activation import str_to_activation
from fms.utils.config import ModelConfig

from vllm_accel.kernels import span_attention
from vllm_accel.model.half_split_rope import rotate_halves
from vllm_accel.model.qwen2_layers import rms_norm


class PatchTowerShape:
    """What a Qwen-VL tower config derives from its fields (emb_dim, nheads,
    in_channels, temporal_patch_size, patch_size)."""

    @property
    def head_dim(self) -> int:
        return self.emb_dim // self.nheads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass
class Qwen2_5_VisionConfig(ModelConfig, PatchTowerShape):
    depth: int = 32
    emb_dim: int = 1280
    nheads: int = 16
    hidden_dim: int = 3420  # MLP inner size (HF intermediate_size)
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112  # pixels
    fullatt_block_indexes: list[int] = field(default_factory=lambda: [7, 15, 23, 31])
    out_dim: int = 2048  # = the text model's emb_dim
    norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    activation_fn: str = "silu"


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention with rotary q/k and an explicit
    boolean mask. (FMS's MultiHeadAttention takes positions, not the
    precomputed 2-D rotary angles this tower needs.)"""

    def __init__(self, emb_dim: int, nheads: int):
        super().__init__()
        self.nheads = nheads
        self.qkv = nn.Linear(emb_dim, 3 * emb_dim)  # rows: all q heads, all k, all v
        self.dense = nn.Linear(emb_dim, emb_dim)

    def forward(self, x, cos, sin, mask, ranges):
        """x [N, D], cos/sin [N, head_dim / 2], mask (True = may attend): [N, N],
        or [chunks, band, 3 * band] for ``banded_attention``; ranges [N, 2]:
        the same keys as spans, for ``span_attention`` on the CPU."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.nheads, -1).unbind(1)  # [N, H, hd] each
        # Rotary in float32, as HF does for the vision tower, on each head's
        # halves (HF's rotate_half made inductor write four float32 copies of
        # q and k first: 8 of a full-size block's ~140 ms).
        q, k = (rotate_halves(t, cos[:, None], sin[:, None]) for t in (q, k))
        if q.device.type == "cpu":  # frames and windows are spans of rows
            out = span_attention.attend(q[None], k[None], v[None], q.shape[-1] ** -0.5,
                                          ranges[None])[0]
        elif mask.dim() == 3:  # a window block: a band of rows around each chunk
            out = banded_attention(q, k, v, mask)
        else:  # full attention over the call (the mask keeps images apart)
            # 4-D: the CPU's flash kernel takes only that (3-D ran as bmm,
            # softmax, bmm: 3x slower for the full-size tower)
            out = F.scaled_dot_product_attention(
                *(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask
            )[0].transpose(0, 1)
        return self.dense(out.reshape(n, -1))


def banded_attention(q, k, v, mask):
    """Attention where every row sees only rows near it: q/k/v [N, H, hd],
    mask [chunks, band, 3 * band] bool -> [N, H, hd]. The rows, padded to
    chunks * band, are cut into chunks of ``band``; chunk i's queries attend
    to the keys of chunks i-1, i and i+1 (zero rows beyond either end) where
    the mask allows. Exact for any mask whose allowed keys all lie in that
    band: a window of at most ``band`` consecutive rows does. Work grows with
    N (not N^2, as one masked attention over the call would)."""
    n, heads, dim = q.shape
    chunks, band = mask.shape[:2]
    extra = chunks * band - n

    def keys(t):  # [N, H, hd] -> [chunks, H, 3 * band, hd]
        return F.pad(t, (0, 0, 0, 0, band, extra + band)).unfold(0, 3 * band, band) \
            .permute(0, 1, 3, 2)

    queries = F.pad(q, (0, 0, 0, 0, 0, extra)).view(chunks, band, heads, dim).transpose(1, 2)
    # SDPA (the flash kernel), not matmul-softmax-matmul: in bfloat16 a
    # matmul rounds the scores to bfloat16 before the softmax (1.7x SDPA's
    # error against float32), and float32 scores by matmul cost more than
    # the flash kernel here.
    out = F.scaled_dot_product_attention(queries, keys(k), keys(v), attn_mask=mask[:, None])
    return out.transpose(1, 2).reshape(chunks * band, heads, dim)[:n]


class Qwen2_5_VisionBlock(nn.Module):
    def __init__(self, config: Qwen2_5_VisionConfig):
        super().__init__()
        c = config
        self.ln = rms_norm(c.emb_dim, c.norm_eps)
        self.attn = VisionAttention(c.emb_dim, c.nheads)
        self.ff_ln = rms_norm(c.emb_dim, c.norm_eps)
        # Unfused: FMS's fused GLU splits a 3-D [B, T, 2*hidden] tensor.
        self.mlp = GatedLinearUnit(
            c.emb_dim, hidden_grow_factor=(c.hidden_dim + 0.5) / c.emb_dim,
            activation_fn=str_to_activation(c.activation_fn), p_dropout=0.0,
            use_bias=True, fused=False,
        )
        assert self.mlp.hidden_dim == c.hidden_dim

    def forward(self, x, cos, sin, mask, ranges):
        """All inputs have the padded size: x [N, D], cos/sin [N, head_dim / 2],
        mask and ranges as ``VisionAttention``'s. Dynamo-clean (no
        data-dependent Python)."""
        x = x + self.attn(self.ln(x), cos, sin, mask, ranges)
        return x + self.mlp(self.ff_ln(x))


class PatchMerger(nn.Module):
    """RMSNorm, then each run of merge_size**2 consecutive rows (one 2x2
    block of neighbouring patches, by the processor's patch order) becomes one
    row, then a GELU MLP to the text model's width."""

    def __init__(self, config: Qwen2_5_VisionConfig):
        super().__init__()
        merged = config.emb_dim * config.spatial_merge_size**2
        self.ln_q = rms_norm(config.emb_dim, config.norm_eps)
        self.fc1 = nn.Linear(merged, merged)
        self.fc2 = nn.Linear(merged, config.out_dim)

    def forward(self, x):
        x = self.ln_q(x).reshape(-1, self.fc1.in_features)
        return self.fc2(F.gelu(self.fc1(x)))


@dataclass
class VisionLayout:
    """Everything the tower needs that depends on the image grid, for one
    padded size. Built eagerly (Python loops, argsort) outside compiled code."""

    order: torch.Tensor  # [N_padded] patch rows in window order, then the padding rows
    restore: torch.Tensor  # [N_real / merge**2] merged rows back to the processor's order
    # [N_padded, head_dim / 2] rotary angles in `order`, dims i and i + head_dim / 2
    # turning together (HF's table repeats them for both halves); float32
    # whatever the pixels' dtype, as HF's (and so one kind of call for the
    # compiled blocks: vLLM sends bfloat16 pixels, the warmup float32 ones)
    cos: torch.Tensor
    sin: torch.Tensor
    full_mask: torch.Tensor  # [N_padded, N_padded] bool: same frame
    # [chunks, band, 3 * band] bool: same window, for banded_attention (a
    # window's rows are consecutive, at most band = the rows of a full window)
    window_mask: torch.Tensor
    # [N_padded, 2] int32: each row's frame (window) as the span of rows
    # [first, last + 1), for the CPU kernel (frames and windows are consecutive)
    full_ranges: torch.Tensor
    window_ranges: torch.Tensor


def row_spans(seg: torch.Tensor) -> torch.Tensor:
    """Each row's run of equal segment ids as [first, last + 1): [rows, 2] int32."""
    starts = torch.ones(len(seg), dtype=torch.bool)
    starts[1:] = seg[1:] != seg[:-1]
    first = torch.nonzero(starts).flatten()
    run = torch.cumsum(starts, 0) - 1
    last = torch.cat([first[1:], torch.tensor([len(seg)])])
    return torch.stack([first[run], last[run]], -1).int()


def axial_angles(head_dim: int, theta: float, rows: torch.Tensor, cols: torch.Tensor,
                 num_pad: int) -> torch.Tensor:
    """2-D rotary angles [patches + num_pad, head_dim / 2] float32 of patches
    at (rows, cols): the first half of the frequencies turn with the row, the
    second half with the column (HF's axial rope); padding gets angle 0."""
    half = head_dim // 2  # HF: the frequencies of a head_dim/2 rope, per axis
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
    pos = torch.stack([rows, cols], dim=-1).float()  # [N_real, 2]
    freqs = (pos[..., None] * inv_freq).flatten(1)  # [N_real, head_dim / 2]: rows then columns
    return torch.cat([freqs, freqs.new_zeros(num_pad, freqs.shape[1])])


def vision_layout(config: Qwen2_5_VisionConfig, grid_thw: Sequence[Sequence[int]],
                  num_padded: int, device: torch.device | str = "cpu") -> VisionLayout:
    """grid_thw: per image (frames t, patch rows h, patch columns w), as the
    image processor returns. num_padded: total patch rows including padding.
    Built on the host, returned on ``device`` (where the tower runs)."""
    m = config.spatial_merge_size
    unit = m * m
    win = config.window_size // m // config.patch_size  # window side in merged tokens
    unit_ids, frame_seg, window_seg, rows, cols = [], [], [], [], []
    units_done = frames_done = windows_done = 0
    for t, h, w in (tuple(int(v) for v in g) for g in grid_thw):
        hm, wm = h // m, w // m
        tt, r, c = torch.meshgrid(torch.arange(t), torch.arange(hm), torch.arange(wm), indexing="ij")
        tt, r, c = tt.flatten(), r.flatten(), c.flatten()
        wins_h, wins_w = -(-hm // win), -(-wm // win)
        window = (tt * wins_h + r // win) * wins_w + c // win
        # Window order: windows row-major, merged tokens row-major inside a window.
        key = window * win * win + (r % win) * win + (c % win)
        perm = torch.argsort(key)
        unit_ids.append(perm + units_done)
        frame_seg.append(tt[perm] + frames_done)
        window_seg.append(window[perm] + windows_done)
        # Patch (row, column) of each patch of each merged token, in window order.
        dr, dc = torch.meshgrid(torch.arange(m), torch.arange(m), indexing="ij")
        rows.append((r[perm, None] * m + dr.flatten()).flatten())
        cols.append((c[perm, None] * m + dc.flatten()).flatten())
        units_done += t * hm * wm
        frames_done += t
        windows_done += t * wins_h * wins_w
    window_index = torch.cat(unit_ids)
    num_real = units_done * unit
    num_pad = num_padded - num_real
    if num_pad < 0 or num_pad % unit:
        raise ValueError(f"{num_padded} patch rows for {num_real} real patches: padding must be "
                         f"a non-negative multiple of {unit}")

    patch_order = (window_index[:, None] * unit + torch.arange(unit)).flatten()
    order = torch.cat([patch_order, torch.arange(num_real, num_padded)])
    pad_seg = torch.full((num_pad,), -1)  # padding: one segment of its own

    def per_row(seg_per_unit):  # a segment per row: its unit's; padding its own
        return torch.cat([seg_per_unit.repeat_interleave(unit), pad_seg])

    def same(seg):
        return seg[:, None] == seg[None, :]

    def same_in_band(seg):
        band = win * win * unit
        chunks = -(-num_padded // band)
        outside = torch.full((band,), -2)  # rows past either end (and the last chunk's rest)
        seg = torch.cat([outside, seg, outside[: chunks * band - num_padded], outside])
        queries = seg[band : band + chunks * band].view(chunks, band)
        return queries[:, :, None] == seg.unfold(0, 3 * band, band)[:, None, :]

    frame_rows, window_rows = per_row(torch.cat(frame_seg)), per_row(torch.cat(window_seg))

    angles = axial_angles(config.head_dim, config.rope_theta, torch.cat(rows), torch.cat(cols),
                          num_pad)
    return VisionLayout(
        order=order.to(device),
        restore=torch.argsort(window_index).to(device),
        cos=angles.cos().to(device),
        sin=angles.sin().to(device),
        full_mask=same(frame_rows).to(device),
        window_mask=same_in_band(window_rows).to(device),
        full_ranges=row_spans(frame_rows).to(device),
        window_ranges=row_spans(window_rows).to(device),
    )


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, config: Qwen2_5_VisionConfig):
        super().__init__()
        self.config = config
        # A Conv3d whose kernel equals its stride, on patches the processor
        # already flattened, is a linear layer over the flattened patch.
        self.patch_embed = nn.Linear(config.patch_dim, config.emb_dim, bias=False)
        self.layers = nn.ModuleList(Qwen2_5_VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)

    def forward(self, pixel_values: torch.Tensor, grid_thw, layout: Optional[VisionLayout] = None):
        """pixel_values [N_padded, C*T*P*P] (real patches first, in the image
        processor's order, then any padding rows; the pad count must be a
        multiple of spatial_merge_size**2). grid_thw [images, 3].
        Returns [N_real / merge**2, out_dim]: the image tokens, in prompt order."""
        if layout is None:
            layout = vision_layout(self.config, torch.as_tensor(grid_thw).tolist(),
                                   pixel_values.shape[0], pixel_values.device)
        full = set(self.config.fullatt_block_indexes)
        x = self.patch_embed(pixel_values.to(self.merger.ln_q.weight.dtype))[layout.order]
        for i, layer in enumerate(self.layers):
            if i in full:
                x = layer(x, layout.cos, layout.sin, layout.full_mask, layout.full_ranges)
            else:
                x = layer(x, layout.cos, layout.sin, layout.window_mask, layout.window_ranges)
        merged = self.merger(x)
        return merged[layout.restore]  # padding rows come after the real ones: dropped
