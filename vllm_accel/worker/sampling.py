"""Sampling a step's tokens with vLLM's own sampler, over the logits
``execute_model`` left (``PendingSample``), grammar bitmasks applied."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.sampler import Sampler
from vllm.v1.structured_output.utils import apply_grammar_bitmask
from vllm.v1.worker.gpu_input_batch import InputBatch


@dataclass
class PendingSample:
    """What execute_model leaves for sample_tokens."""

    scheduler_output: SchedulerOutput
    logits: torch.Tensor | None  # [num_reqs, vocab], InputBatch order; driver only
    discard: np.ndarray  # [num_reqs] bool: partial prefill, token not kept
    prompt_logprobs: dict[str, LogprobsTensors]  # requests whose prompt is done


def sample(sampler: Sampler, batch: InputBatch, pending: PendingSample,
           grammar_output: GrammarOutput | None) -> SamplerOutput:
    if grammar_output is not None:
        apply_grammar_bitmask(pending.scheduler_output, grammar_output, batch, pending.logits)
    # A seeded request whose token is thrown away (a prefill chunk that does
    # not end the prompt) must not advance its generator.
    saved_rng = {i: g.get_state() for i, g in batch.generators.items() if pending.discard[i]}
    # Async scheduling: penalties need last step's tokens, now on the host.
    batch.update_async_output_token_ids()
    output = sampler(logits=pending.logits, sampling_metadata=batch.sampling_metadata)
    for i, state in saved_rng.items():
        batch.generators[i].set_state(state)
    return output
