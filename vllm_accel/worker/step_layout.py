"""Where each token of an engine step goes: pure functions, no engine needed.

A step runs as one forward over one packed sequence: one token per decoding
request first, then the prefill chunks, then padding up to a token bucket.
``pack_step`` computes that layout from vLLM's per-request state (token ids,
computed-token counts, block tables); ``placeholder_rows`` finds, within it,
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
    causal_context_mask,
)


@dataclass
class StepLayout:
    """One step's tokens packed into a sequence padded to a token bucket."""

    input_ids: torch.Tensor  # [1, padded_tokens]
    # Rotary positions: [1, padded_tokens], or [3, 1, padded_tokens] for models
    # with 3-D (M-RoPE) positions; padding at position 0.
    positions: torch.Tensor
    attn_metadata: PagedAttentionMetadata
    last_token: torch.Tensor  # [num_reqs] packed index of each request's last token, by row
    # Per packed request (decodes first): batch row, first packed token,
    # number of tokens, and the position of its first token in its sequence.
    rows: np.ndarray
    firsts: np.ndarray
    counts: np.ndarray
    starts: np.ndarray


def pack_step(
    token_ids: np.ndarray,
    block_table: np.ndarray,
    num_scheduled: np.ndarray,
    start: np.ndarray,
    block_size: int,
    token_bucket: Callable[[int], int],
    context_bucket: Callable[[int], int],
    rope_positions: Sequence[RopePositions | None] | None = None,
) -> StepLayout:
    """Pack decodes, then prefill chunks, into one padded token sequence.

    token_ids [rows, max_len] and block_table [rows, max_blocks] are the batch's
    (``InputBatch``); row i runs num_scheduled[i] tokens from position start[i].
    ``token_bucket(tokens)`` and ``context_bucket(blocks)`` give the padded sizes.
    ``rope_positions[row]``, for models with 3-D positions, gives each row's.
    """
    bs = block_size
    is_decode = num_scheduled == 1
    order = np.concatenate([np.flatnonzero(is_decode), np.flatnonzero(~is_decode)])
    counts = num_scheduled[order]
    ends = np.cumsum(counts)
    firsts = ends - counts
    total = int(ends[-1])
    padded = token_bucket(total)

    row_of_token = np.repeat(order, counts)
    pos = start[row_of_token] + np.arange(total) - np.repeat(firsts, counts)
    input_ids = np.zeros(padded, dtype=np.int64)
    positions = np.zeros(padded, dtype=np.int64)
    slots = np.zeros(padded, dtype=np.int64)  # padding writes into block 0 (vLLM's null block)
    input_ids[:total] = token_ids[row_of_token, pos]
    positions[:total] = pos
    slots[:total] = block_table[row_of_token, pos // bs] * bs + pos % bs
    last_token = np.empty(len(order), dtype=np.int64)
    last_token[order] = ends - 1

    num_decodes = int(is_decode.sum())
    decode_rows = order[:num_decodes]
    context_lens = start[decode_rows] + 1
    width = context_bucket(cdiv(int(context_lens.max(initial=1)), bs))
    decode_mask = np.arange(width * bs)[None, :] < context_lens[:, None]
    prefills = []
    for row, first, count in zip(order[num_decodes:], firsts[num_decodes:],
                                 counts[num_decodes:]):
        context_len = int(start[row] + count)
        blocks = cdiv(context_len, bs)
        prefills.append(PrefillChunk(
            start=int(first),
            end=int(first + count),
            block_table=torch.from_numpy(block_table[row : row + 1, :blocks].astype(np.int64)),
            mask=causal_context_mask(
                torch.from_numpy(positions[first : first + count][None]),
                torch.tensor([context_len]),
                blocks * bs,
            ),
        ))
    rotary = torch.from_numpy(positions)[None]
    if rope_positions is not None:
        rotary = torch.from_numpy(
            _rope_positions(rope_positions, order, firsts, counts, start, padded))[:, None]
    metadata = PagedAttentionMetadata(
        slot_mapping=torch.from_numpy(slots),
        num_decodes=num_decodes,
        decode_block_table=torch.from_numpy(block_table[decode_rows, :width].astype(np.int64)),
        decode_mask=torch.from_numpy(decode_mask[:, None, None, :]),
        prefills=prefills,
    )
    return StepLayout(
        input_ids=torch.from_numpy(input_ids)[None],
        positions=rotary,
        attn_metadata=metadata,
        last_token=torch.from_numpy(last_token),
        rows=order,
        firsts=firsts,
        counts=counts,
        starts=start[order],
    )


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


def _rope_positions(rope_positions, order, firsts, counts, start, padded) -> np.ndarray:
    out = np.zeros((3, padded), dtype=np.int64)
    for row, first, count in zip(order, firsts, counts):
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
    for row, first, count, start in zip(layout.rows, layout.firsts, layout.counts,
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
