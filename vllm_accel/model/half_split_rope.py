"""Rotary embedding on each head's two halves instead of FMS's adjacent pairs.

FMS's ``RotaryEmbedding`` rotates dims (0, 1), (2, 3), ... of a head: each
output reads two neighbours, and inductor compiles that to a scalar loop. A
rotation is the same arithmetic on any pairing, and attention only ever takes
dot products of a query and a key head, which a permutation applied to both
leaves as they were. So ``install`` reorders each head's query and key
projection rows (even dims first, then odd: pair i becomes dims i and
i + head/2, HF's own "rotate half" layout) and rotates the halves: contiguous
slices that inductor vectorizes. Values, outputs and the logits are unchanged;
the KV cache holds keys in the new order (only our attention reads it).

Where FMS's angles depend on the sequence length (NTK, YaRN), the head is only
partly rotated, or the projection normalises each head (its weights would need
the same reordering), the model keeps FMS's rotary.
"""

from __future__ import annotations

import torch
from fms.modules.attention import FusedQKV, MultiHeadAttention, UnfusedQKV
from fms.modules.positions import PositionEncoder, RotaryEmbedding

# FMS rope types whose angles do not depend on the sequence length.
_FIXED_ANGLES = ("regular", "llama3")


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [..., head] rotated in float32, dims i and i + head/2 a pair, by
    angles whose ``cos`` / ``sin`` [..., head/2] broadcast against each half:
    slices inductor vectorizes (HF's rotate_half, a cat, and FMS's adjacent
    pairs both compile to extra copies or scalar loops). Each half is cast
    back before the cat, so inductor writes the halves straight into the
    output: cast after it, a bfloat16 ``x`` had the rotated halves written to
    a float32 copy first, then cast."""
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat([(cos * first - sin * second).type_as(x),
                      (sin * first + cos * second).type_as(x)], dim=-1)


class HalfSplitRotary(PositionEncoder):
    """FMS's rotation angles (its own table, to ``max_positions``) applied to
    heads whose pairs are (i, i + head/2)."""

    def __init__(self, rotary: RotaryEmbedding, max_positions: int, device: torch.device):
        alpha = rotary.compute_freqs_cis(device, max_positions)
        table = rotary.cached_freqs[device.index][alpha]  # [positions, head/2, 2, 2]
        if table.shape[0] < max_positions:  # FMS keeps a shorter table it built first
            rotary.cached_freqs[device.index].pop(alpha)
            rotary.max_seq_len_cached[device.index] = 0
            alpha = rotary.compute_freqs_cis(device, max_positions)
            table = rotary.cached_freqs[device.index][alpha]
        self.cos = table[..., 0, 0].contiguous()  # [positions, head/2] float32
        self.sin = table[..., 1, 0].contiguous()

    def adjusted_qk(self, q, k, position_ids, past_kv_state=None, use_cache=False):
        """q [B, L, heads, head], k [B, L, kv_heads, head]; position_ids [B, L]."""
        cos = self.cos[position_ids].unsqueeze(2)  # [B, L, 1, head/2]
        sin = self.sin[position_ids].unsqueeze(2)
        return rotate_halves(q, cos, sin), rotate_halves(k, cos, sin)  # float32, as FMS's


def _supported(rotary) -> bool:
    return (type(rotary) is RotaryEmbedding and rotary.partial_rope == 1.0
            and rotary.rope_type in _FIXED_ANGLES)


def _halves_order(head: int, device) -> torch.Tensor:
    """New dim j of a head takes old dim order[j]: evens, then odds."""
    return torch.cat([torch.arange(0, head, 2), torch.arange(1, head, 2)]).to(device)


def _reorder_rows(tensor: torch.Tensor, start: int, heads: int, head: int) -> None:
    """Reorder, in place, rows [start, start + heads * head) head by head."""
    rows = tensor.data[start:start + heads * head]
    shaped = rows.view(heads, head, *rows.shape[1:])
    shaped.copy_(shaped.index_select(1, _halves_order(head, tensor.device)))


def _reorder_projection(attn: MultiHeadAttention) -> bool:
    """Reorder the query and key projection rows of ``attn``; False (nothing
    changed) for a projection this does not know."""
    proj, head = attn.in_proj, attn.emb_kq_per_head
    if getattr(proj, "apply_norm_per_head", None) or head % 2:
        return False
    if isinstance(proj, FusedQKV) and type(proj.qkv_fused) is torch.nn.Linear:
        parts = [(proj.qkv_fused, 0, attn.nheads),
                 (proj.qkv_fused, attn.nheads * head, attn.kvheads)]
    elif (isinstance(proj, UnfusedQKV) and type(proj.query) is torch.nn.Linear
          and type(proj.key) is torch.nn.Linear):
        parts = [(proj.query, 0, attn.nheads), (proj.key, 0, attn.kvheads)]
    else:
        return False
    with torch.no_grad():
        for linear, start, heads in parts:
            _reorder_rows(linear.weight, start, heads, head)
            if linear.bias is not None:
                _reorder_rows(linear.bias, start, heads, head)
    return True


def install(model: torch.nn.Module, max_positions: int) -> int:
    """Switch every attention layer of ``model`` that uses FMS's rotary (of
    fixed angles) to ``HalfSplitRotary``, its projections reordered to match.
    Before the linear layers are packed. Returns how many layers switched."""
    switched, encoders = 0, {}
    for attn in model.modules():
        if not isinstance(attn, MultiHeadAttention) or not _supported(attn.position_encoder):
            continue
        rotary = attn.position_encoder
        if id(rotary) not in encoders:
            device = next(attn.parameters()).device
            encoders[id(rotary)] = HalfSplitRotary(rotary, max_positions, device)
        if _reorder_projection(attn):
            attn.position_encoder = encoders[id(rotary)]
            switched += 1
    return switched
