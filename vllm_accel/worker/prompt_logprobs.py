"""Prompt logprobs, chunk by chunk (pure: no engine, no model).

vLLM's semantics: the logprob of each prompt token given the ones before it,
top-k alternatives included, returned once the whole prompt is done (a request
that asks for them never reads the prefix cache, so every prompt position is
computed in some step). Position i predicts prompt token i + 1, so the last
prompt token predicts none. A step that runs a request's positions
``[num_computed, num_computed + num_scheduled)`` scores the part of them that
predicts prompt tokens; ``plan_chunk`` says which.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptLogprobsChunk:
    positions: slice  # prompt positions scored this step (their predictions)
    targets: list[int]  # the prompt tokens they predict: prompt[positions + 1]
    finished: bool  # every prompt position is scored: hand the result to vLLM

    @property
    def num_logits(self) -> int:
        return self.positions.stop - self.positions.start


def plan_chunk(prompt_token_ids: list[int], num_computed: int,
               num_scheduled: int) -> PromptLogprobsChunk:
    """What a step running ``num_scheduled`` tokens from ``num_computed`` scores."""
    predicting = len(prompt_token_ids) - 1 - num_computed  # positions left that predict
    num_logits = max(0, min(num_scheduled, predicting))
    start = num_computed
    return PromptLogprobsChunk(
        positions=slice(start, start + num_logits),
        targets=list(prompt_token_ids[start + 1 : start + 1 + num_logits]),
        finished=num_scheduled > predicting,
    )
