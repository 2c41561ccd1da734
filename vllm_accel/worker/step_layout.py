"""Where each token of an engine step goes: pure functions, no engine needed.

A step packs its tokens into one sequence: one token per decoding request
first, then the prefill chunks. The sequence runs as one forward padded up to
a token bucket, or as a few forwards over consecutive slices of it when that
pads less (``buckets.plan_forwards``: 370 tokens run as 256 + 64 + 64, not
padded to 1024). ``pack_step`` computes that layout from vLLM's per-request
state (token ids, computed-token counts, block tables), plain numpy/torch on
the host, tested in tests/test_step_layout.py (as is ``multimodal_rows``:
where the step's multimodal embeddings go).

A model whose attention layers are of several kinds (full attention beside
sliding windows) has a KV cache group per kind in vLLM's hybrid KV cache
manager, each with its own block table: a token has a slot in each group,
and each forward a layout per group (``attention_layouts``), with its
group's window.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from vllm.utils.math_utils import cdiv

from vllm_accel.model.mamba2 import RecurrentLayout
from vllm_accel.model.paged_attention import (
    AttentionLayouts,
    PagedAttentionMetadata,
    PrefillChunk,
    SequenceTable,
    TableShape,
    causal_context_mask,
)
from vllm_accel.worker.multimodal_rows import RopePositions


@dataclass(frozen=True)
class AttentionGroup:
    """A KV cache group of attention layers: its block table (the batch's,
    ``InputBatch``'s [rows, max_blocks]) and its layers' window (0: none)."""

    block_table: np.ndarray
    window: int = 0


class BucketedForward:
    """One model call: tokens [begin, end) of the step's packed sequence,
    padded to ``bucket`` tokens (padding sits at position 0 and writes its
    keys/values into block 0, vLLM's null block).

    Two views of it: its unpadded rows as numpy (``token_ids``, ``rotary``,
    ``slots``, ``logit_index``, ``table_rows``: what a device buffer takes,
    forward_inputs.py, without building tensors first) and its padded tensors
    (``input_ids``, ``positions``, ``attention_layouts``, ``logit_rows``),
    built on first use. Slots, table rows and layouts are each attention
    group's (``group``: its index among ``groups``; the first by default).
    """

    def __init__(self, packed: _Packed, begin: int, end: int, bucket: int,
                 groups: Sequence[AttentionGroup], block_size: int,
                 context_bucket: Callable[[int], int], table_shape: TableShape | None):
        self.begin, self.end, self.bucket = begin, end, bucket
        self.groups = groups
        self._packed, self._block_size = packed, block_size
        self._context_bucket, self._table_shape = context_bucket, table_shape
        last = packed.last_tokens
        whole = begin == 0 and end == len(packed.ids)  # the common case: one forward
        # The requests whose last token this forward holds, in packed order:
        # that token's index in the forward (its hidden state gives the
        # request's logits).
        self.logit_index = last if whole else last[(last >= begin) & (last < end)] - begin
        self.token_ids = packed.ids[begin:end]
        self.rotary = packed.rotary[:, begin:end]  # [1 or 3, tokens]

    @property
    def slots(self) -> np.ndarray:
        """The first attention group's KV cache slot of each token."""
        return self.group_slots(0)

    def group_slots(self, group: int) -> np.ndarray:
        return self._packed.slots[group][self.begin:self.end]

    def table_rows(self, group: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The forward's sequences, unpadded: each one's first query (its
        packed index in the forward), context length and block table row in
        attention group ``group`` (``table_shape``'s width)."""
        packed, begin, end = self._packed, self.begin, self.end
        lo, hi, order = packed.first_tokens, packed.first_tokens + packed.counts, packed.order
        if begin > 0 or end < len(packed.ids):
            lo, hi = np.clip(lo, begin, end), np.clip(hi, begin, end)
            inside = lo < hi
            lo, hi, order = lo[inside], hi[inside], order[inside]
        return (lo - begin, packed.pos[hi - 1] + 1,
                self.groups[group].block_table[order, : self._table_shape.width])

    @functools.cached_property
    def input_ids(self) -> torch.Tensor:
        """[1, bucket], padded with 0."""
        return torch.from_numpy(_padded(self.token_ids, self.bucket))[None]

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """Rotary positions: [1, bucket], or [3, 1, bucket] for models with 3-D
        (M-RoPE) positions."""
        positions = torch.from_numpy(_padded(self.rotary, self.bucket))
        return positions if positions.shape[0] == 1 else positions[:, None]

    @functools.cached_property
    def logit_rows(self) -> torch.Tensor:
        return torch.from_numpy(self.logit_index)

    @property
    def attn_metadata(self) -> PagedAttentionMetadata:
        """The first attention group's layout."""
        return self.attention_layouts[0]

    @functools.cached_property
    def attention_layouts(self) -> AttentionLayouts:
        """The forward's layout in each attention group."""
        return tuple(self._layout(g) for g in range(len(self.groups)))

    def _layout(self, group: int) -> PagedAttentionMetadata:
        packed, begin, end = self._packed, self.begin, self.end
        window = self.groups[group].window
        slots = torch.from_numpy(_padded(self.group_slots(group), self.bucket))  # padding: block 0
        num_decodes = max(0, min(end, packed.num_decodes) - begin)
        if self._table_shape is not None:
            return PagedAttentionMetadata(slots, num_decodes,
                                          sequences=self._sequence_table(group), window=window)
        return _split_metadata(packed, begin, end, slots, num_decodes,
                               self.groups[group].block_table, self._block_size,
                               self._context_bucket, window)

    def recurrent_layout(self, state_tables: Sequence[np.ndarray]) -> RecurrentLayout:
        """The forward's requests as segments (decodes first), each with the
        block of its recurrent state in every recurrent KV cache group
        (``state_tables[g]``: that group's block table, one block per
        request) and whether it goes on from that state (its first token in
        this forward is not its sequence's first)."""
        packed, begin, end = self._packed, self.begin, self.end
        lo = np.clip(packed.first_tokens, begin, end)
        hi = np.clip(packed.first_tokens + packed.counts, begin, end)
        inside = lo < hi
        lo, hi, rows = lo[inside], hi[inside], packed.order[inside]
        blocks = np.stack([table[rows, 0] for table in state_tables]).astype(np.int64)
        return RecurrentLayout(
            num_decodes=max(0, min(end, packed.num_decodes) - begin),
            starts=(lo - begin).tolist(), ends=(hi - begin).tolist(),
            has_state=torch.from_numpy(packed.pos[lo] > 0),
            state_blocks=torch.from_numpy(blocks))

    def _sequence_table(self, group: int) -> SequenceTable:
        """``table_rows`` as a ``SequenceTable`` of the bucket's fixed shape
        (padding rows: no queries, no context)."""
        rows = self._table_shape.rows(self.bucket)
        first, seq_lens, blocks = self.table_rows(group)
        query_start = np.full(rows + 1, self.end - self.begin, dtype=np.int32)
        query_start[: len(first)] = first
        return SequenceTable(torch.from_numpy(query_start),
                             torch.from_numpy(_padded(seq_lens.astype(np.int32), rows)),
                             torch.from_numpy(_padded(blocks.astype(np.int32), rows, axis=0)))


def _padded(values: np.ndarray, size: int, axis: int = -1) -> np.ndarray:
    """``values`` zero-padded to ``size`` along ``axis`` (the first or last)."""
    shape = list(values.shape)
    shape[axis] = size
    out = np.zeros(shape, dtype=values.dtype)
    if axis == 0:
        out[: len(values)] = values
    else:
        out[..., : values.shape[-1]] = values
    return out


@dataclass
class StepLayout:
    """One step's tokens packed into one sequence, run as one or more forwards."""

    input_ids: torch.Tensor  # [1, tokens], unpadded
    forwards: list[BucketedForward]  # consecutive slices of the sequence, in order
    # Per packed request (decodes first): batch row, packed index of its first
    # token, number of tokens, and the position of its first token in its sequence.
    rows: np.ndarray
    first_tokens: np.ndarray
    counts: np.ndarray
    starts: np.ndarray

    def in_batch_order(self, logits: list[torch.Tensor]) -> torch.Tensor:
        """Each forward's logits (a row per packed request, decodes first) as
        one tensor, a row per request in batch order."""
        logits = logits[0] if len(logits) == 1 else torch.cat(logits)
        if np.array_equal(self.rows, np.arange(len(self.rows))):
            return logits
        by_row = torch.from_numpy(np.argsort(self.rows))
        return logits[by_row.to(logits.device, non_blocking=True)]


def pack_step(
    token_ids: np.ndarray,
    block_table: np.ndarray | Sequence[AttentionGroup],
    num_scheduled: np.ndarray,
    start: np.ndarray,
    block_size: int,
    plan_forwards: Callable[[int], list[int]],
    context_bucket: Callable[[int], int],
    rope_positions: Sequence[RopePositions | None] | None = None,
    table_shape: TableShape | None = None,
    window: int = 0,
) -> StepLayout:
    """Pack decodes, then prefill chunks, into one sequence and cut it into
    forwards.

    token_ids [rows, max_len] and block_table [rows, max_blocks] are the batch's
    (``InputBatch``): one table for a model whose attention layers share one
    KV cache group (their window: ``window``), or an ``AttentionGroup`` per
    group; row i runs num_scheduled[i] tokens from position start[i].
    ``plan_forwards(tokens)`` gives the token bucket of each forward (every one
    but the last full), ``context_bucket(blocks)`` the padded decode context.
    ``rope_positions[row]``, for models with 3-D positions, gives each row's.
    With ``table_shape`` each forward's attention layout is a ``SequenceTable``
    of that shape (fixed per bucket: cuda), else decodes and prefill chunks
    apart. ``window``: the one group's attention window (0: none).
    """
    groups = ([AttentionGroup(block_table, window)] if isinstance(block_table, np.ndarray)
              else list(block_table))
    bs = block_size
    is_decode = num_scheduled == 1
    order = np.concatenate([np.flatnonzero(is_decode), np.flatnonzero(~is_decode)])
    counts = num_scheduled[order]
    ends = np.cumsum(counts)
    first_tokens = ends - counts
    total = int(ends[-1])

    row_of_token = np.repeat(order, counts)
    pos = start[row_of_token] + np.arange(total) - np.repeat(first_tokens, counts)
    slots = [g.block_table[row_of_token, pos // bs] * bs + pos % bs for g in groups]
    rotary = pos[None]
    if rope_positions is not None:
        rotary = _rope_positions(rope_positions, order, first_tokens, counts, start, total)

    ids = token_ids[row_of_token, pos].astype(np.int64)
    packed = _Packed(order, first_tokens, counts, int(is_decode.sum()), ids, pos, slots, rotary,
                     ends - 1)
    forwards, begin = [], 0
    for bucket in plan_forwards(total):
        end = min(total, begin + bucket)
        forwards.append(BucketedForward(packed, begin, end, bucket, groups, bs,
                                        context_bucket, table_shape))
        begin = end
    assert begin == total, f"the forwards cover {begin} of {total} tokens"
    return StepLayout(
        input_ids=torch.from_numpy(ids)[None],
        forwards=forwards,
        rows=order,
        first_tokens=first_tokens,
        counts=counts,
        starts=start[order],
    )


@dataclass
class _Packed:
    """The packed sequence, unpadded: what each forward takes its slice of."""

    order: np.ndarray  # batch row of each packed request (decodes first)
    first_tokens: np.ndarray
    counts: np.ndarray
    num_decodes: int  # packed requests [0, num_decodes) decode one token each
    ids: np.ndarray  # [tokens] token ids
    pos: np.ndarray  # [tokens] position of each token in its sequence
    slots: list[np.ndarray]  # per attention group: [tokens] each token's KV cache slot
    rotary: np.ndarray  # [1 or 3, tokens] its rotary positions
    last_tokens: np.ndarray  # packed index of each packed request's last token


def _split_metadata(packed: _Packed, begin: int, end: int, slots: torch.Tensor,
                    num_decodes: int, block_table: np.ndarray, bs: int,
                    context_bucket: Callable[[int], int], window: int) -> PagedAttentionMetadata:
    """The layout of packed tokens [begin, end) as decodes and prefill chunks
    apart (cpu, hpu). With a window, each one's context starts at the first
    block its window reaches: the blocks wholly behind it (vLLM's null block
    once freed) are neither gathered nor masked."""
    pos = packed.pos
    # Decodes are the first packed tokens, one per request.
    decodes = np.arange(begin, min(end, packed.num_decodes))
    decode_rows = packed.order[decodes]
    context_lens = pos[decodes] + 1
    skipped = np.maximum(context_lens - window, 0) // bs if window else 0 * context_lens
    context_lens = context_lens - skipped * bs
    width = context_bucket(cdiv(int(context_lens.max(initial=1)), bs))
    columns = skipped[:, None] + np.arange(width)[None, :]
    decode_table = np.take_along_axis(
        np.pad(block_table[decode_rows], ((0, 0), (0, width))), columns, axis=1)
    prefills = []
    for i in range(packed.num_decodes, len(packed.order)):
        # The part of request i's chunk inside this forward (if any).
        lo = max(int(packed.first_tokens[i]), begin)
        hi = min(int(packed.first_tokens[i] + packed.counts[i]), end)
        if lo >= hi:
            continue
        if pos[lo] == 0:  # the prompt's start: no earlier context to read
            chunk = PrefillChunk(start=lo - begin, end=hi - begin)
            if chunk.outruns(window):  # causal within the window, over its own keys
                chunk.mask = causal_context_mask(torch.from_numpy(pos[lo:hi][None]),
                                                 torch.tensor([hi - lo]), hi - lo, window)
            prefills.append(chunk)
            continue
        row = packed.order[i]
        # From the first block the chunk's first query's window reaches.
        skip = max(0, int(pos[lo]) - window + 1) // bs if window else 0
        context_len = int(pos[hi - 1]) + 1 - skip * bs
        blocks = cdiv(context_len, bs)
        prefills.append(PrefillChunk(
            start=lo - begin,
            end=hi - begin,
            block_table=torch.from_numpy(
                block_table[row : row + 1, skip : skip + blocks].astype(np.int64)),
            mask=causal_context_mask(
                torch.from_numpy(pos[lo:hi][None] - skip * bs), torch.tensor([context_len]),
                blocks * bs, window),
            context_len=context_len,
        ))
    return PagedAttentionMetadata(
        slot_mapping=slots,
        num_decodes=num_decodes,
        decode_block_table=torch.from_numpy(decode_table.astype(np.int64)),
        decode_context_lens=torch.from_numpy(context_lens.astype(np.int64)),
        prefills=prefills,
        window=window,
        decodes_outrun_window=0 < window < int(context_lens.max(initial=0)),
    )


def _rope_positions(rope_positions, order, first_tokens, counts, start, total) -> np.ndarray:
    out = np.zeros((3, total), dtype=np.int64)
    for row, first, count in zip(order, first_tokens, counts):
        out[:, first : first + count] = rope_positions[row].at(int(start[row]), int(count))
    return out
