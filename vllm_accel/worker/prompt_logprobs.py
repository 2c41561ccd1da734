"""Prompt logprobs, chunk by chunk (``plan_chunk`` is pure: no engine, no model).

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

import numpy as np
import torch
from vllm.v1.outputs import LogprobsTensors


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


def compute_prompt_logprobs(step, hidden: torch.Tensor, scheduler_output, requests,
                            input_batch, compute_logits, sampler, logprobs_mode: str
                            ) -> dict[str, LogprobsTensors]:
    """Prompt logprobs of the step's requests that asked for them, filled in
    chunk by chunk from the step's ``hidden`` states [1, tokens, hidden] (in
    the step's packed order); returned for a request once its whole prompt is
    done. Driver only."""
    finished = {}
    for req_id, count in scheduler_output.num_scheduled_tokens.items():
        state = requests[req_id]
        num_logprobs = state.prompt_logprobs_pending
        if num_logprobs is None:
            continue
        prompt = state.prompt_token_ids
        if state.in_progress_prompt_logprobs_cpu is None:
            state.in_progress_prompt_logprobs_cpu = LogprobsTensors.empty_cpu(
                len(prompt) - 1, num_logprobs + 1)
        tensors = state.in_progress_prompt_logprobs_cpu
        chunk = plan_chunk(prompt, state.num_computed_tokens, count)
        if chunk.finished:
            finished[req_id] = tensors
            state.prompt_logprobs_pending = None
            state.in_progress_prompt_logprobs_cpu = None
        if chunk.num_logits == 0:
            continue
        row = input_batch.req_id_to_index[req_id]
        first = int(step.first_tokens[np.flatnonzero(step.rows == row)[0]])
        logits = compute_logits(hidden[0, first : first + chunk.num_logits])
        if logprobs_mode not in ("raw_logits", "processed_logits"):
            logits = sampler.compute_logprobs(logits)
        targets = torch.tensor(chunk.targets, device=logits.device)
        token_ids, logprobs, ranks, *_ = sampler.gather_logprobs(logits, num_logprobs, targets)
        tensors.logprob_token_ids[chunk.positions] = token_ids.cpu()
        tensors.logprobs[chunk.positions] = logprobs.cpu()
        tensors.selected_token_ranks[chunk.positions] = ranks.cpu()
    return finished
