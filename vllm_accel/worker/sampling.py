"""Sampling a step's tokens with vLLM's own sampler, over the logits
``execute_model`` left (``PendingSample``), grammar bitmasks applied, and
the step's output for vLLM's engine (``step_output``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.outputs import LogprobsTensors, ModelRunnerOutput, SamplerOutput
from vllm.v1.sample.sampler import Sampler
from vllm.v1.structured_output.utils import apply_grammar_bitmask
from vllm.v1.worker.gpu_input_batch import InputBatch

from vllm_accel.worker.in_flight import PLACEHOLDER, InFlightOutput
from vllm_accel.worker.request_state import RequestStates

if TYPE_CHECKING:
    from vllm_accel.worker.model_runner import AccelModelRunner


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


def sample_step(runner: AccelModelRunner, pending: PendingSample,
                grammar_output: GrammarOutput | None) -> ModelRunnerOutput | InFlightOutput:
    """The step's tokens: sampled by the driver, broadcast to the other
    tensor-parallel ranks so that every rank's requests stay in step."""
    batch = runner.input_batch
    output = None
    if runner.is_driver:
        output = sample(runner.sampler, batch, pending, grammar_output)
        sampled_ids = output.sampled_token_ids.to(torch.int64)
    else:
        sampled_ids = torch.empty((batch.num_reqs, 1), dtype=torch.int64, device=runner.device)
    if runner.tp_size > 1:
        from vllm.distributed import get_tp_group

        # On the device: the group's backend (gloo, nccl) reads it there.
        sampled_ids = get_tp_group().broadcast(sampled_ids.to(runner.device).contiguous(),
                                               src=0)
    runner.compile_stats.after_step("sampling")  # vLLM's sampler compiles helpers too
    logprobs = output.logprobs_tensors if output is not None else None
    return step_output(batch, runner.requests, pending, sampled_ids, logprobs,
                       runner.device if runner.async_scheduling else None)


def step_output(batch: InputBatch, requests: RequestStates, pending: PendingSample,
                sampled_ids: torch.Tensor, logprobs: LogprobsTensors | None,
                in_flight_device: torch.device | None) -> ModelRunnerOutput | InFlightOutput:
    """The step's output for vLLM's engine, the kept tokens appended to their
    requests. ``in_flight_device``: with async scheduling, the device where
    the sampled tokens stay for the next step's inputs; the host gets
    placeholders now and the tokens when vLLM asks for them."""
    result = ModelRunnerOutput(
        req_ids=list(batch.req_ids),
        req_id_to_index=dict(batch.req_id_to_index),
        sampled_token_ids=[],
        prompt_logprobs_dict=pending.prompt_logprobs,
    )
    kept = np.flatnonzero(~pending.discard).tolist()  # rows whose token is kept
    if in_flight_device is not None:
        batch.prev_sampled_token_ids = sampled_ids.to(in_flight_device)
        # Its own dict: removing a request pops it from this one.
        batch.prev_req_id_to_index = (
            dict(result.req_id_to_index) if len(kept) == batch.num_reqs
            else {batch.req_ids[i]: i for i in kept})
        requests.append_tokens(kept, [PLACEHOLDER] * len(kept))
        in_flight = InFlightOutput(result, sampled_ids, logprobs, pending.discard)
        batch.set_async_sampled_token_ids(in_flight.sampled_cpu, in_flight.ready)
        return in_flight
    sampled = [token_ids[0] for token_ids in sampled_ids.tolist()]
    requests.append_tokens(kept, [sampled[i] for i in kept])
    result.sampled_token_ids = [[token] for token in sampled]
    for i in np.flatnonzero(pending.discard):
        result.sampled_token_ids[i] = []
    result.logprobs = logprobs.tolists() if logprobs is not None else None
    return result
