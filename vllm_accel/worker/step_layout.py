"""Where each token of an engine step goes: pure functions, no engine needed.

A step packs its tokens into one sequence: one token per decoding request
first, then the prefill chunks. The sequence runs as one forward padded up to
a token bucket, or as a few forwards over consecutive slices of it when that
pads less (``buckets.plan_forwards``: 370 tokens run as 256 + 64 + 64, not
padded to 1024). ``pack_step`` computes that layout from vLLM's per-request
state (token ids, computed-token counts, block tables); ``placeholder_rows``
finds, within the sequence,
the positions that take multimodal embeddings and which encoder-output rows
go there. Both are plain numpy/torch on the host, tested in
tests/test_step_layout.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from vllm.utils.math_utils import cdiv

from vllm_accel.model.paged_attention import (
    PagedAttentionMetadata,
    PrefillChunk,
    SequenceTable,
    TableShape,
    causal_context_mask,
)


@dataclass
class BucketedForward:
    """One model call: tokens [begin, end) of the step's packed sequence,
    padded to ``bucket`` tokens (padding sits at position 0 and writes its
    keys/values into block 0, vLLM's null block)."""

    begin: int
    end: int
    bucket: int
    input_ids: torch.Tensor  # [1, bucket], padded with 0
    # Rotary positions: [1, bucket], or [3, 1, bucket] for models with 3-D
    # (M-RoPE) positions.
    positions: torch.Tensor
    attn_metadata: PagedAttentionMetadata
    # The requests whose last token this forward holds, in packed order: that
    # token's index in the forward (its hidden state gives the request's logits).
    logit_rows: torch.Tensor


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


def pack_step(
    token_ids: np.ndarray,
    block_table: np.ndarray,
    num_scheduled: np.ndarray,
    start: np.ndarray,
    block_size: int,
    plan_forwards: Callable[[int], list[int]],
    context_bucket: Callable[[int], int],
    rope_positions: Sequence[RopePositions | None] | None = None,
    table_shape: TableShape | None = None,
) -> StepLayout:
    """Pack decodes, then prefill chunks, into one sequence and cut it into
    forwards.

    token_ids [rows, max_len] and block_table [rows, max_blocks] are the batch's
    (``InputBatch``); row i runs num_scheduled[i] tokens from position start[i].
    ``plan_forwards(tokens)`` gives the token bucket of each forward (every one
    but the last full), ``context_bucket(blocks)`` the padded decode context.
    ``rope_positions[row]``, for models with 3-D positions, gives each row's.
    With ``table_shape`` each forward's attention layout is a ``SequenceTable``
    of that shape (fixed per bucket: cuda), else decodes and prefill chunks
    apart.
    """
    bs = block_size
    is_decode = num_scheduled == 1
    order = np.concatenate([np.flatnonzero(is_decode), np.flatnonzero(~is_decode)])
    counts = num_scheduled[order]
    ends = np.cumsum(counts)
    first_tokens = ends - counts
    total = int(ends[-1])

    row_of_token = np.repeat(order, counts)
    pos = start[row_of_token] + np.arange(total) - np.repeat(first_tokens, counts)
    slots = block_table[row_of_token, pos // bs] * bs + pos % bs
    rotary = pos[None]
    if rope_positions is not None:
        rotary = _rope_positions(rope_positions, order, first_tokens, counts, start, total)

    ids = token_ids[row_of_token, pos].astype(np.int64)
    packed = _Packed(order, first_tokens, counts, int(is_decode.sum()), ids, pos, slots, rotary)
    forwards, begin = [], 0
    for bucket in plan_forwards(total):
        end = min(total, begin + bucket)
        forwards.append(_forward(packed, begin, end, bucket, block_table, bs, context_bucket,
                                 table_shape))
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
    slots: np.ndarray  # [tokens] its KV cache slot
    rotary: np.ndarray  # [1 or 3, tokens] its rotary positions


def _forward(packed: _Packed, begin: int, end: int, bucket: int, block_table: np.ndarray,
             bs: int, context_bucket: Callable[[int], int],
             table_shape: TableShape | None) -> BucketedForward:
    """The forward over packed tokens [begin, end), padded to ``bucket``."""
    ids = np.zeros((1, bucket), dtype=np.int64)
    ids[0, : end - begin] = packed.ids[begin:end]
    last = packed.first_tokens + packed.counts - 1
    logit_rows = torch.from_numpy(last[(last >= begin) & (last < end)] - begin)
    positions = np.zeros((packed.rotary.shape[0], bucket), dtype=np.int64)
    positions[:, : end - begin] = packed.rotary[:, begin:end]
    positions = torch.from_numpy(positions)
    # [1, bucket] for 1-D positions, [3, 1, bucket] for 3-D ones.
    positions = positions if packed.rotary.shape[0] == 1 else positions[:, None]
    slots = np.zeros(bucket, dtype=np.int64)  # padding writes into block 0 (vLLM's null block)
    slots[: end - begin] = packed.slots[begin:end]
    slots = torch.from_numpy(slots)
    num_decodes = max(0, min(end, packed.num_decodes) - begin)
    if table_shape is not None:
        table = _sequence_table(packed, begin, end, table_shape.rows(bucket), block_table,
                                table_shape.width)
        metadata = PagedAttentionMetadata(slots, num_decodes, sequences=table)
        return BucketedForward(begin, end, bucket, torch.from_numpy(ids), positions, metadata,
                               logit_rows)
    pos = packed.pos
    # Decodes are the first packed tokens, one per request.
    decodes = np.arange(begin, min(end, packed.num_decodes))
    decode_rows = packed.order[decodes]
    context_lens = pos[decodes] + 1
    width = context_bucket(cdiv(int(context_lens.max(initial=1)), bs))
    prefills = []
    for i in range(packed.num_decodes, len(packed.order)):
        # The part of request i's chunk inside this forward (if any).
        lo = max(int(packed.first_tokens[i]), begin)
        hi = min(int(packed.first_tokens[i] + packed.counts[i]), end)
        if lo >= hi:
            continue
        if pos[lo] == 0:  # the prompt's start: no earlier context to read
            prefills.append(PrefillChunk(start=lo - begin, end=hi - begin))
            continue
        row = packed.order[i]
        context_len = int(pos[hi - 1]) + 1
        blocks = cdiv(context_len, bs)
        prefills.append(PrefillChunk(
            start=lo - begin,
            end=hi - begin,
            block_table=torch.from_numpy(block_table[row : row + 1, :blocks].astype(np.int64)),
            mask=causal_context_mask(
                torch.from_numpy(pos[lo:hi][None]), torch.tensor([context_len]), blocks * bs),
        ))
    metadata = PagedAttentionMetadata(
        slot_mapping=slots,
        num_decodes=num_decodes,
        decode_block_table=torch.from_numpy(block_table[decode_rows, :width].astype(np.int64)),
        decode_context_lens=torch.from_numpy(context_lens.astype(np.int64)),
        prefills=prefills,
    )
    return BucketedForward(begin, end, bucket, torch.from_numpy(ids), positions, metadata,
                           logit_rows)


def _sequence_table(packed: _Packed, begin: int, end: int, rows: int, block_table: np.ndarray,
                    width: int) -> SequenceTable:
    """The packed requests' parts within tokens [begin, end) as the rows of a
    ``SequenceTable`` of ``rows`` rows (padding rows: no queries, no context)."""
    lo = np.clip(packed.first_tokens, begin, end)
    hi = np.clip(packed.first_tokens + packed.counts, begin, end)
    inside = lo < hi
    lo, hi, order = lo[inside], hi[inside], packed.order[inside]
    query_start = np.full(rows + 1, end - begin, dtype=np.int32)
    query_start[: len(lo)] = lo - begin
    seq_lens = np.zeros(rows, dtype=np.int32)
    seq_lens[: len(lo)] = packed.pos[hi - 1] + 1
    table = np.zeros((rows, width), dtype=np.int32)
    table[: len(lo)] = block_table[order, :width]
    return SequenceTable(torch.from_numpy(query_start), torch.from_numpy(seq_lens),
                         torch.from_numpy(table))


@dataclass(frozen=True)
class RopePositions:
    """A request's 3-D rotary positions (M-RoPE: temporal, height, width).

    The prompt's are computed from its images; every later token t sits at
    t + delta on all three axes (text continues after the largest position).
    """

    prompt: np.ndarray  # [3, prompt_len] int64
    delta: int

    def at(self, first: int, count: int) -> np.ndarray:
        """[3, count] positions of tokens first .. first + count - 1."""
        pos = np.arange(first, first + count)
        out = np.broadcast_to(pos + self.delta, (3, count)).copy()
        in_prompt = pos < self.prompt.shape[1]
        out[:, in_prompt] = self.prompt[:, pos[in_prompt]]
        return out


def _rope_positions(rope_positions, order, first_tokens, counts, start, total) -> np.ndarray:
    out = np.zeros((3, total), dtype=np.int64)
    for row, first, count in zip(order, first_tokens, counts):
        out[:, first : first + count] = rope_positions[row].at(int(start[row]), int(count))
    return out


@dataclass(frozen=True)
class Placeholder:
    """One multimodal item's span of the prompt (vLLM's ``PlaceholderRange``)."""

    key: str  # the item's identifier (its encoder output is cached under it)
    offset: int  # first prompt position of the span
    length: int
    # Which positions of the span take embeddings (None: all of them). The
    # others (e.g. column or start/end tokens) stay text.
    is_embed: np.ndarray | None = None


def placeholder_rows(
    layout: StepLayout, placeholders: Sequence[Sequence[Placeholder]]
) -> tuple[np.ndarray, list[tuple[str, int, int]]]:
    """The packed positions this step fills with multimodal embeddings, and the
    encoder-output rows that go there, in packed order.

    ``placeholders[row]`` lists batch row ``row``'s items. Returns a bool mask
    over the padded sequence and ``(key, first_row, end_row)`` slices of each
    item's encoder output (which has one row per embed position), also when a
    prefill chunk cuts through a span.
    """
    is_mm = np.zeros(layout.input_ids.shape[1], dtype=bool)
    slices = []
    for row, first, count, start in zip(layout.rows, layout.first_tokens, layout.counts,
                                        layout.starts):
        end = start + count
        for item in placeholders[row]:
            lo, hi = max(start, item.offset), min(end, item.offset + item.length)
            if lo >= hi:
                continue
            span = slice(lo - item.offset, hi - item.offset)
            packed = first + lo - start + np.arange(hi - lo)
            if item.is_embed is None:
                is_mm[packed] = True
                slices.append((item.key, span.start, span.stop))
                continue
            embed = item.is_embed[span]
            if not embed.any():
                continue
            is_mm[packed[embed]] = True
            before = int(item.is_embed[: span.start].sum())
            slices.append((item.key, before, before + int(embed.sum())))
    return is_mm, slices
