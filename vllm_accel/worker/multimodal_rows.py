"""Where a step's multimodal inputs go: each request's 3-D rotary positions
(M-RoPE) and, within the step's packed sequence (``step_layout``), the
positions that take multimodal embeddings and the encoder-output rows that
go there. Plain numpy on the host."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from vllm_accel.worker.step_layout import StepLayout


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
