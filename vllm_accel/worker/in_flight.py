"""Async scheduling: tokens still on the device when the next step starts.

With vLLM's async scheduling the engine schedules and launches step N+1
before it reads step N's sampled tokens, so the host works on the next step
while the device computes. For the runner that means two things:

- ``InFlightOutput``: step N's output is returned before its tokens reach
  the host; their copy is queued behind the step's kernels and
  ``get_output()`` waits for it (vLLM's ``AsyncModelRunnerOutput``).
- ``tokens_in_flight``: step N+1 feeds each continuing request the token it
  sampled at step N, which the host does not know yet (the ``InputBatch``
  holds -1 there, as vLLM's GPU runner does); the runner copies it into the
  step's input ids on the device, from ``prev_sampled_token_ids``.

On a device that computes synchronously (cpu) this changes no result and
overlaps nothing; the platform turns async scheduling on only where the
device runs apart from the host (settings: ``async_scheduling``).
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.outputs import AsyncModelRunnerOutput, LogprobsTensors, ModelRunnerOutput
from vllm.v1.worker.gpu_input_batch import InputBatch

PLACEHOLDER = -1  # vLLM's placeholder for a sampled token not yet on the host


class _Copied:
    """The ready event of a copy that was synchronous (cpu)."""

    def synchronize(self) -> None:
        pass


def _ready_event(device: torch.device):
    if device.type == "cuda":
        event = torch.cuda.Event()
        event.record()
        return event
    return _Copied()


class InFlightOutput(AsyncModelRunnerOutput):
    """A step's output whose sampled tokens (and logprobs) are still being
    copied to the host."""

    def __init__(self, output: ModelRunnerOutput, sampled: torch.Tensor,
                 logprobs: LogprobsTensors | None, discard: np.ndarray):
        self._output = output
        self._discard = discard  # rows whose token is thrown away (partial prefill)
        self._sampled = sampled  # kept alive until the copy is done
        self.sampled_cpu = sampled.to("cpu", non_blocking=True)
        self._logprobs_cpu = logprobs.to_cpu_nonblocking() if logprobs is not None else None
        self.ready = _ready_event(sampled.device)

    def get_output(self) -> ModelRunnerOutput:
        self.ready.synchronize()
        del self._sampled
        tokens = self.sampled_cpu.tolist()
        for i in np.flatnonzero(self._discard):
            tokens[i] = []
        self._output.sampled_token_ids = tokens
        if self._logprobs_cpu is not None:
            self._output.logprobs = self._logprobs_cpu.tolists()
        return self._output

    def get_kv_connector_output(self):
        return self._output.kv_connector_output  # None: no KV connectors here


NO_TOKENS_IN_FLIGHT = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


def tokens_in_flight(batch: InputBatch, rows: np.ndarray, first_tokens: np.ndarray,
                     host_ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Where the tokens sampled last step go in this step's packed ids: the
    packed index of each continuing request's first token (``host_ids``
    [1, tokens] holds the placeholder there) and its row in last step's
    ``prev_sampled_token_ids``. ``rows``/``first_tokens``: the batch row and
    the packed index of each packed request (``StepLayout``). The runner
    copies them on the device, forward by forward."""
    previous = batch.prev_req_id_to_index
    if not previous or batch.prev_sampled_token_ids is None:
        return NO_TOKENS_IN_FLIGHT
    sources = np.array([previous.get(req_id, -1) for req_id in batch.req_ids], dtype=np.int64)
    packed_first = np.empty(batch.num_reqs, dtype=np.int64)
    packed_first[rows] = first_tokens
    continuing = sources >= 0
    targets, sources = packed_first[continuing], sources[continuing]
    # Each continuing request decodes the token it sampled: the host must
    # hold the placeholder there, or the two views of the request disagree.
    known = host_ids[0].numpy()[targets]
    if (known != PLACEHOLDER).any():
        raise RuntimeError(
            f"async scheduling: expected the placeholder {PLACEHOLDER} at the packed "
            f"positions {targets.tolist()} of the tokens in flight, found {known.tolist()}")
    return targets, sources


def in_forward(in_flight: tuple[np.ndarray, np.ndarray], begin: int, end: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """The tokens in flight that land in the step's packed tokens [begin,
    end) (one forward's), their targets counted from ``begin``."""
    targets, sources = in_flight
    if len(targets) and (begin > 0 or targets.max() >= end):
        inside = (targets >= begin) & (targets < end)
        return targets[inside] - begin, sources[inside]
    return in_flight


def copy_in_flight(input_ids: torch.Tensor, previous_sampled: torch.Tensor,
                   targets: torch.Tensor, sources: torch.Tensor) -> None:
    """Write last step's sampled tokens (rows ``sources`` of
    ``previous_sampled`` [rows, 1]) into ``input_ids`` [1, tokens] at
    ``targets``, on the device. index_select/index_copy_ rather than
    advanced indexing, whose CUDA dispatch took ~90 us of host time a step
    (torch profiler)."""
    sampled = previous_sampled[:, 0].index_select(0, sources)
    input_ids[0].index_copy_(0, targets, sampled)
