"""Paged attention in plain PyTorch, plugged into FMS's attention-op registry.

vLLM's KV cache manager hands out fixed-size blocks; the scheduler sends, per
request, the list of block ids that hold its context. Each layer's cache is a
pair of tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``.

The runner feeds the model a padded batch ``[batch, query_len]``. Per step we

1. *store*: write the new keys/values into their slots (``slot_mapping``;
   padding tokens write into block 0, which vLLM never hands to a request);
2. *compute*: gather each row's context through its block table into
   ``[batch, context_len]`` and run one masked SDPA over the whole batch.

Every shape is fixed by (batch, query_len, blocks per row), so a bucketed
runner can compile one graph per bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from fms.modules.attention import register_attention_op

ATTN_NAME = "vllm_accel_paged"


@dataclass
class PagedAttentionMetadata:
    """What every layer needs to read and write the paged KV cache."""

    slot_mapping: torch.Tensor  # [batch, query_len] int64: cache slot per new token
    block_table: torch.Tensor  # [batch, max_blocks] int64: block ids per row
    mask: torch.Tensor  # [batch, 1, query_len, max_blocks * block_size] bool

    def as_kwargs(self) -> dict:
        return {
            "attn_name": ATTN_NAME,
            "slot_mapping": self.slot_mapping,
            "block_table": self.block_table,
            "mask": self.mask,
        }


def build_attention_mask(
    positions: torch.Tensor, context_lens: torch.Tensor, context_len: int
) -> torch.Tensor:
    """Causal mask over the gathered context: a token at position p sees keys
    0..p of its own row, and never keys past the row's context length."""
    key_pos = torch.arange(context_len, device=positions.device)
    visible = key_pos[None, None, :] <= positions[:, :, None]
    visible &= key_pos[None, None, :] < context_lens[:, None, None]
    return visible.unsqueeze(1)


def _store(keys, values, key_cache, value_cache, *, slot_mapping, **_):
    # keys/values: [batch, query_len, kv_heads, head_dim]
    num_blocks, block_size, kv_heads, head_dim = key_cache.shape
    slots = slot_mapping.reshape(-1)
    key_cache.view(-1, kv_heads, head_dim).index_copy_(
        0, slots, keys.reshape(-1, kv_heads, head_dim)
    )
    value_cache.view(-1, kv_heads, head_dim).index_copy_(
        0, slots, values.reshape(-1, kv_heads, head_dim)
    )
    return key_cache, value_cache, key_cache, value_cache


def _compute(
    query, key_cache, value_cache, nheads, kvheads, p_dropout, scale_factor,
    *, block_table, mask, **_,
):
    # query: [batch, query_len, heads, head_dim] -> [batch, heads, query_len, head_dim]
    batch = query.shape[0]
    head_dim = key_cache.shape[-1]
    keys = key_cache[block_table].view(batch, -1, kvheads, head_dim).transpose(1, 2)
    values = value_cache[block_table].view(batch, -1, kvheads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2),
        keys,
        values,
        attn_mask=mask,
        scale=scale_factor,
        enable_gqa=nheads != kvheads,
    )
    return out.transpose(1, 2).contiguous()


_registered = False


def register_paged_attention() -> None:
    """Register the op with FMS once per process (FMS refuses duplicates)."""
    global _registered
    if not _registered:
        register_attention_op(ATTN_NAME, _store, _compute)
        _registered = True
