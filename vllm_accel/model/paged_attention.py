"""Paged attention in plain PyTorch, plugged into FMS's attention-op registry.

vLLM's KV cache manager hands out fixed-size blocks; the scheduler sends, per
request, the block ids that hold its context. Each layer's cache is a pair of
tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``.

The runner packs all tokens of a step into one sequence: decode tokens first
(one per request), then prefill chunks; each forward takes a slice of it
``[1, tokens]``, padded up to a token bucket. Attention is one opaque custom op, like vLLM's own attention
ops: compiled graphs see only ``[1, tokens]`` tensors, so their shapes depend
on the token bucket alone, while the op reads the per-step layout (slots, block
tables, masks) from the forward's context (``ForwardContext.attention``). Per layer it

1. writes the new keys/values into their slots (padding writes go to block 0,
   which vLLM never hands to a request; on the CPU by the decode kernel's
   library, a copy per token row), unless the layer's graph wrote them (see
   below);
2. attends: all decodes at once, over block tables padded to a context bucket
   (on the CPU with our kernel that reads the blocks in place,
   kernels/decode_attention.py);
   each prefill chunk over its own context (a chunk that starts its prompt:
   causally over its own new keys, nothing read from the cache; on the CPU
   with AVX-512 by our kernel, kernels/span_attention.py).

On a GPU the layout comes as one ``SequenceTable`` instead (decodes and
chunks alike are sequences of queries over their blocks), and one launch of
vLLM's Triton kernel attends the whole forward: no gathered copies, no loop
over chunks, and tensors of fixed shapes that a CUDA graph can capture. There
the layers store the new keys/values themselves: the forward passes the slot
mapping to FMS's store step (``kv_slots``), which writes both caches with
``index_put_`` inside the layer's compiled graph, where inductor can fuse the
writes with the keys' rotary (on the cpu it made one kernel of them) instead
of a launch of the rotary's and one of a store; the op is told
(``kv_stored``) and only attends.

Layers of different attention kinds (full attention beside sliding windows)
sit in different KV cache groups of vLLM's hybrid KV cache manager, each with
its own block table and so its own slots: the forward's context holds a
layout per (group, window) (``AttentionLayouts``), and a layer's op is told
which (an index in an int tensor, kept on the host, that the layer's KV cache
entry carries: a graph input, so that every layer runs one graph). The
layout carries its window. A layer with attention sinks (a learned logit per head that joins
the softmax's denominator only) hands the op its sinks: on the CPU those
layers attend by PyTorch with an explicit softmax (SDPA and our kernels take
no sinks); vLLM's Triton kernel takes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from fms.modules.attention import register_attention_op

from vllm_accel import compat
from vllm_accel.forward_context import get_forward_context
from vllm_accel.kernels import ops, span_attention

ATTN_NAME = "vllm_accel_paged"


@dataclass
class PrefillChunk:
    """One request's prompt tokens in a forward. A chunk that starts the
    prompt (no earlier context) attends to its own new keys/values causally;
    one with earlier context, over its blocks in the cache."""

    start: int  # first token of the chunk in the packed sequence
    end: int
    block_table: torch.Tensor | None = None  # [1, blocks] the request's blocks
    # [1, 1, chunk_len, keys] bool: over its blocks' keys (blocks * block_size),
    # or, at the prompt's start, over its own (only where a window cuts them).
    mask: torch.Tensor | None = None
    context_len: int = 0  # with blocks: tokens before the chunk's end (its last key)

    def outruns(self, window: int) -> bool:
        """Whether some query of the chunk sees less than all keys before it:
        the chunk reaches past an attention window (0: none)."""
        return 0 < window < max(self.context_len, self.end - self.start)


@dataclass
class SequenceTable:
    """A forward's tokens as sequences of queries (decodes, then prefill
    chunks, in packed order), each over its own blocks: the layout vLLM's
    Triton kernel reads. Rows past the forward's sequences are padding (no
    queries, no context), so the shapes depend on the token bucket only."""

    query_start: torch.Tensor  # [rows + 1] int32: packed index of each row's first query
    seq_lens: torch.Tensor  # [rows] int32: tokens the row's last query sees
    block_table: torch.Tensor  # [rows, width] int32


@dataclass(frozen=True)
class TableShape:
    """The fixed shape of every forward's ``SequenceTable``: a row for each
    sequence one forward can hold (no more than its tokens, nor than the
    scheduler's ``max_num_seqs``), each ``width`` blocks (the widest context
    bucket). Fixed per token bucket, so one CUDA graph per bucket."""

    max_sequences: int
    width: int

    def rows(self, bucket: int) -> int:
        return min(bucket, self.max_sequences)


@dataclass
class PagedAttentionMetadata:
    """The per-step token layout every layer's attention reads: decodes and
    prefill chunks apart (cpu, hpu), or one ``SequenceTable`` (cuda)."""

    slot_mapping: torch.Tensor  # [tokens] int64: cache slot of each packed token
    num_decodes: int  # tokens [0, num_decodes) are decodes, one per request
    decode_block_table: torch.Tensor | None = None  # [num_decodes, context_bucket] int64
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int64: tokens each sees
    prefills: list[PrefillChunk] = field(default_factory=list)
    sequences: SequenceTable | None = None
    # Sliding-window attention: a query sees the last ``window`` keys up to
    # itself (0: all of them). ``decodes_outrun_window``: some decode's context
    # is longer than the window (else the window changes nothing for them).
    window: int = 0
    decodes_outrun_window: bool = False
    # cuda: the Triton kernel's split-KV scratch (forwards of few tokens).
    split_kv: compat.SplitKvScratch | None = None

    @property
    def tokens(self) -> int:
        """Tokens the step fills (decodes, then chunks in packed order); the
        rows past them are the token bucket's padding."""
        return self.prefills[-1].end if self.prefills else self.num_decodes

    @property
    def stored_by_layers(self) -> bool:
        """Whether the layers write the step's keys/values into the caches in
        their own graphs, before the op (the one-launch layout of a GPU)."""
        return self.sequences is not None

    def to(self, device: torch.device) -> PagedAttentionMetadata:
        """The same layout with its tensors on ``device`` (built on the host;
        a GPU's attention reads them there: no host round trip per layer)."""
        if self.slot_mapping.device == device:
            return self

        def copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
            # Queued behind the device's work, not waiting for it (the host
            # memory is staged at once, so it may change after).
            return None if tensor is None else tensor.to(device, non_blocking=True)

        table = self.sequences
        return PagedAttentionMetadata(
            copy(self.slot_mapping), self.num_decodes, copy(self.decode_block_table),
            copy(self.decode_context_lens),
            [PrefillChunk(c.start, c.end, copy(c.block_table), copy(c.mask), c.context_len)
             for c in self.prefills],
            None if table is None else SequenceTable(
                copy(table.query_start), copy(table.seq_lens), copy(table.block_table)),
            self.window, self.decodes_outrun_window, self.split_kv,
        )


def causal_context_mask(
    positions: torch.Tensor, context_lens: torch.Tensor, context_len: int, window: int = 0
) -> torch.Tensor:
    """[rows, 1, queries, context_len]: the query at position p sees keys 0..p
    of its own row (p - window + 1..p with a window), never past the row's
    context length."""
    key_pos = torch.arange(context_len)[None, None, :]
    query_pos = positions[:, :, None]
    visible = (key_pos <= query_pos) & (key_pos < context_lens[:, None, None])
    if window:
        visible &= key_pos > query_pos - window
    return visible.unsqueeze(1)


# A forward's layouts: one per (KV cache group, window) of its attention
# layers (one for a model whose attention layers are all of one kind).
AttentionLayouts = tuple[PagedAttentionMetadata, ...]


def layouts_to(layouts: AttentionLayouts, device: torch.device) -> AttentionLayouts:
    return tuple(md.to(device) for md in layouts)


def _paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
    layout: torch.Tensor | None = None,
    kv_stored: bool = False,
) -> torch.Tensor:
    """query [1, tokens, heads, dim], key/value [1, tokens, kv_heads, dim] ->
    [1, tokens, heads, dim]; writes key/value into their cache slots (unless
    ``kv_stored``: the caller has). ``sinks`` [heads]: each head's sink logit
    (None: no sinks); ``layout`` [1] int64 on the host: the index of the
    layer's layout among the forward's (None: the first)."""
    context = get_forward_context()
    layouts = context.attention
    assert layouts, "paged_attention runs inside set_forward_context with a layout"
    md = layouts[0 if layout is None else int(layout)]
    if md.sequences is not None:
        # Rows past the forward's sequences stay unwritten: padding, which no
        # real row reads.
        out = query.new_empty(query.shape)
        table = md.sequences
        if not kv_stored:
            compat.triton_store_kv(key[0], value[0], key_cache, value_cache, md.slot_mapping)
        compat.triton_paged_attention(
            query[0].contiguous(), key_cache, value_cache, out[0], table.query_start,
            table.seq_lens, table.block_table, scale, md.window, md.split_kv, sinks)
        return out
    decode_kernel = context.kernels.decode
    if not kv_stored and (decode_kernel is None or not decode_kernel.store(
            key[0], value[0], key_cache, value_cache, md.slot_mapping)):
        kv_heads, head_dim = key_cache.shape[-2:]
        key_cache.view(-1, kv_heads, head_dim).index_copy_(0, md.slot_mapping, key[0])
        value_cache.view(-1, kv_heads, head_dim).index_copy_(0, md.slot_mapping, value[0])

    # Every row is written below but the padding.
    out = query.new_empty(query.shape)
    out[0, md.tokens:].zero_()
    if md.num_decodes:
        _attend_decodes(query[0, : md.num_decodes], key_cache, value_cache, md, scale,
                        out[0, : md.num_decodes], decode_kernel, sinks)
    by_kernel = sinks is None and span_attention.supported(query)
    for chunk in md.prefills:
        # One request's chunk: its tokens are the query rows of one sequence.
        rows = slice(chunk.start, chunk.end)
        if by_kernel and not chunk.outruns(md.window):
            # On the CPU: our kernel, causal over the chunk's own keys
            # (the prompt's start: the projections' layout, no copies) or over
            # its context's blocks (its own keys are their last).
            if chunk.block_table is None:
                keys, values = key[:, rows], value[:, rows]
            else:
                keys, values = (  # back to [1, tokens, kv_heads, dim], heads contiguous
                    _gather(cache, chunk.block_table).transpose(1, 2)[:, :chunk.context_len]
                    for cache in (key_cache, value_cache))
            out[0, rows] = span_attention.attend(query[:, rows], keys, values, scale,
                                                 causal=True)[0]
            continue
        chunk_query = query[0, rows].transpose(0, 1).unsqueeze(0)
        if chunk.block_table is None:
            # The prompt's start: its keys are the chunk's own, and a causal
            # SDPA (flash on the CPU) needs no gathered copy and no mask (but
            # where a window cuts them).
            keys, values = (t[0, rows].transpose(0, 1).unsqueeze(0) for t in (key, value))
            attended = _sdpa(chunk_query, keys, values, chunk.mask, scale, sinks,
                             is_causal=chunk.mask is None)
        else:
            attended = _attend(chunk_query, key_cache, value_cache, chunk.block_table,
                               chunk.mask, scale, sinks)
        out[0, rows] = attended[0].transpose(0, 1)
    return out


def _attend_decodes(query, key_cache, value_cache, md, scale, out, kernel, sinks=None):
    """query [rows, heads, dim], one decode token per row -> out [rows, heads, dim]
    (by ``kernel``, the decode kernel, where it supports the tensors and no
    sinks join the softmax)."""
    block_table, context_lens = md.decode_block_table, md.decode_context_lens
    if (kernel is not None and sinks is None and kernel.supports(query, key_cache)
            and not md.decodes_outrun_window):
        kernel(query, key_cache, value_cache, block_table, context_lens, scale, out)
        return
    rows, heads, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    width = block_table.shape[1] * key_cache.shape[1]
    key_pos = torch.arange(width, device=context_lens.device)[None, :]
    mask = key_pos < context_lens[:, None]
    if md.decodes_outrun_window:
        mask &= key_pos >= context_lens[:, None] - md.window
    if sinks is not None:  # one query per row: [rows, heads, 1, dim]
        attended = _attend(query[:, :, None], key_cache, value_cache, block_table,
                           mask[:, None, None, :], scale, sinks)
        out.copy_(attended[:, :, 0])
        return
    # PyTorch: the query heads that share a KV head are that row's queries (one
    # SDPA without repeating keys/values), over the gathered context.
    grouped = query.reshape(rows, kv_heads, heads // kv_heads, head_dim)
    attended = _attend(grouped, key_cache, value_cache, block_table, mask[:, None, None, :],
                       scale)
    out.copy_(attended.reshape(rows, heads, head_dim))


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[rows, blocks] block ids -> the rows' context [rows, kv_heads, tokens, dim]."""
    rows = block_table.shape[0]
    kv_heads, head_dim = cache.shape[-2:]
    context = cache.index_select(0, block_table.reshape(-1))
    return context.view(rows, -1, kv_heads, head_dim).transpose(1, 2)


def _attend(query, key_cache, value_cache, block_table, mask, scale, sinks=None):
    """query [rows, heads, queries, dim] over each row's cached context ->
    [rows, heads, queries, dim]; query heads share KV heads (grouped query)."""
    keys, values = _gather(key_cache, block_table), _gather(value_cache, block_table)
    return _sdpa(query, keys, values, mask, scale, sinks)


def _sdpa(query, keys, values, mask, scale, sinks=None, is_causal=False):
    """query [rows, heads, queries, dim] over keys/values [rows, kv_heads,
    keys, dim] (query heads in groups per KV head), ``mask`` bool [rows or 1,
    1, queries, keys] (True: visible) or causal: PyTorch's SDPA, or with
    ``sinks`` [heads] an explicit softmax whose denominator also holds each
    head's sink: HF's formula (its eager attention scales the softmax's
    output by sigmoid(logsumexp(scores) - sink))."""
    if sinks is None:
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, is_causal=is_causal, scale=scale,
            enable_gqa=query.shape[1] != keys.shape[1])
    rows, heads, queries, dim = query.shape
    kv_heads, num_keys = keys.shape[1], keys.shape[2]
    if is_causal:  # the queries are the last of the keys
        mask = torch.ones(queries, num_keys, dtype=torch.bool, device=query.device).tril(
            num_keys - queries)[None, None]
    # Each KV head's query heads as one run of queries: no repeated keys.
    grouped = query.reshape(rows, kv_heads, heads // kv_heads * queries, dim)
    scores = (grouped @ keys.transpose(-1, -2)).view(rows, heads, queries, num_keys) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    scores = scores.float()
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    # softmax over [scores, sink]: softmax(scores) * sigmoid(lse - sink)
    weights = torch.exp(scores - lse) * torch.sigmoid(lse - sinks.float().view(1, heads, 1, 1))
    weights = weights.to(values.dtype).view(rows, kv_heads, -1, num_keys)
    return (weights @ values).view(rows, heads, queries, dim)


def _paged_attention_shape(query, key, value, key_cache, value_cache, scale, sinks=None,
                           layout=None, kv_stored=False):
    return query.new_empty(query.shape)


# The op writes the step's keys/values into both caches: declared (a!, b!), so
# that a compiler orders every read of a cache after the write (inductor then
# updates the caches in place; it does not copy them).
paged_attention = ops.define(
    "paged_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) key_cache, "
    "Tensor(b!) value_cache, float scale, Tensor? sinks=None, Tensor? layout=None, "
    "bool kv_stored=False) -> Tensor",
    _paged_attention, _paged_attention_shape)


def _store(keys, values, key_cache, value_cache, kv_slots=None, **_):
    """FMS's store step. FMS stores, then computes with what store returns;
    the op does both, so the new keys/values and the caches go through
    together. With ``kv_slots`` [tokens] (the forward's slot mapping, passed
    where the layers store) the keys/values are written here, in the layer's
    graph, and the op is told. Written by (block, offset) into the caches
    themselves: inductor updates them in place (through a view of a cache,
    its graph copied the whole cache and back)."""
    stored = kv_slots is not None
    if stored:
        block_size = key_cache.shape[1]
        where = (kv_slots // block_size, kv_slots % block_size)
        key_cache.index_put_(where, keys[0])
        value_cache.index_put_(where, values[0])
    return (keys, key_cache, stored), (values, value_cache, stored), key_cache, value_cache


def _compute(query, keys_and_cache, values_and_cache, nheads, kvheads, p_dropout,
             scale_factor, sinks=None, attention_layout=None, **_):
    """FMS's compute step. ``sinks``: FMS passes a sinks model's per-head sink
    logits (with its ``sliding_window``, which the op ignores: a layer's window
    is its layout's); ``attention_layout``: the index of the layer's layout
    (its KV cache group and window) among the forward's, passed by the layers
    of models whose forwards have several (an int64 tensor on the host)."""
    (keys, key_cache, stored), (values, value_cache, _) = keys_and_cache, values_and_cache
    scale = scale_factor if scale_factor is not None else 1.0 / math.sqrt(query.shape[-1])
    return paged_attention(query, keys, values, key_cache, value_cache, scale, sinks,
                           attention_layout, stored)


_registered = False


def register_paged_attention() -> None:
    """Register the op with FMS once per process (FMS refuses duplicates)."""
    global _registered
    if not _registered:
        register_attention_op(ATTN_NAME, _store, _compute)
        _registered = True
