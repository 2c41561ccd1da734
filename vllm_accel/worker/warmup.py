"""Warmup: run every token bucket through the real execute path once, then
time each bucket's forward.

Each bucket gets a synthetic step made of prefill chunks that fill it exactly,
then a decode step for the same requests, then the requests finish. This is
vLLM's own scheduler-output format, so warmup exercises input packing,
attention, the compiled layers and the sampler exactly as serving does. A
vision model then encodes one real image per vision bucket. Last, with every
graph compiled (and captured, on cuda), with ``forward_plan=measured`` each
bucket's forward is timed, and those times decide how a step is cut into
forwards (``buckets.plan_forwards``; else the padded token counts do).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm.distributed import get_tp_group
from vllm.pooling_params import PoolingParams
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from vllm_accel.buckets import ForwardCosts
from vllm_accel.forward_context import set_forward_context
from vllm_accel.log import get_logger

if TYPE_CHECKING:
    from vllm_accel.worker.model_runner import AccelModelRunner

logger = get_logger(__name__)

# Greedy, then random sampling with top-k/top-p: the sampler's two main paths,
# with logprobs.
_SAMPLING = [
    SamplingParams(temperature=0.0, max_tokens=2, logprobs=1),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=0, max_tokens=2, logprobs=1),
]


def _prompt_lengths(num_tokens: int, max_prompt: int, max_reqs: int) -> list[int]:
    """Split num_tokens into at most max_reqs prompts of at most max_prompt
    tokens (the largest bucket may hold a little less: it still pads to it)."""
    num_reqs = min(max_reqs, num_tokens)
    base, extra = divmod(num_tokens, num_reqs)
    return [min(max_prompt, base + (i < extra)) for i in range(num_reqs)]


def _step(runner: AccelModelRunner, scheduler_output: SchedulerOutput) -> None:
    if runner.execute_model(scheduler_output) is None:
        runner.sample_tokens(None)


def _new_requests(runner: AccelModelRunner, name: str, lengths: list[int],
                  params: SamplingParams | PoolingParams, computed: int = 0) -> SchedulerOutput:
    """A step that prefills ``lengths`` tokens of new prompts, each after
    ``computed`` tokens taken as already in the KV cache (a prefix hit)."""
    next_block = 1  # block 0 is vLLM's null block; others are free during warmup

    def take(blocks: int) -> list[int]:
        nonlocal next_block
        ids = [1 + (next_block + b - 1) % (runner.num_blocks - 1) for b in range(blocks)]
        next_block += blocks
        return ids

    new_reqs = []
    for i, length in enumerate(lengths):
        # Room for the prefill, one decode token and the token it samples, in
        # each attention group (blocks of its own: a block id belongs to one
        # group at a time); a block for each recurrent group's state (models
        # that keep one).
        blocks = -(-(computed + length + 1) // runner.block_size)
        kv = runner.kv_cache
        groups = len(kv.attention_groups) + len(kv.state_groups)
        block_ids = tuple(take(1) if g in kv.state_groups else take(blocks)
                          for g in range(groups))
        new_reqs.append(NewRequestData(
            req_id=f"{name}-{i}", prompt_token_ids=[i % 7 + 10] * (computed + length),
            mm_features=[],
            sampling_params=params if isinstance(params, SamplingParams) else None,
            pooling_params=params.clone() if isinstance(params, PoolingParams) else None,
            block_ids=block_ids, num_computed_tokens=computed, lora_request=None,
        ))
    prefill = SchedulerOutput.make_empty()
    prefill.scheduled_new_reqs = new_reqs
    prefill.num_scheduled_tokens = {r.req_id: n for r, n in zip(new_reqs, lengths)}
    prefill.total_num_scheduled_tokens = sum(lengths)
    return prefill


def _finish(runner: AccelModelRunner, req_ids: list[str]) -> None:
    finish = SchedulerOutput.make_empty()
    finish.finished_req_ids = set(req_ids)
    _step(runner, finish)


def _run_bucket(runner: AccelModelRunner, bucket: int, params: SamplingParams) -> None:
    lengths = _prompt_lengths(bucket, runner.max_model_len - 2, runner.max_num_reqs)
    if runner.pooling is not None:  # prompts only: pooled when prefilled
        task = runner.pooling.supported_tasks()[0]
        prefill = _new_requests(runner, f"warmup-{bucket}", lengths, PoolingParams(task=task))
        _step(runner, prefill)
        _finish(runner, list(prefill.num_scheduled_tokens))
        return
    prefill = _new_requests(runner, f"warmup-{bucket}", lengths, params)
    req_ids = list(prefill.num_scheduled_tokens)
    _step(runner, prefill)

    decode = SchedulerOutput.make_empty()
    decode.scheduled_cached_reqs = CachedRequestData(
        req_ids=req_ids, resumed_req_ids=set(), new_token_ids=[], all_token_ids={},
        new_block_ids=[None] * len(req_ids), num_computed_tokens=lengths,
        num_output_tokens=[1] * len(req_ids),
    )
    decode.num_scheduled_tokens = dict.fromkeys(req_ids, 1)
    decode.total_num_scheduled_tokens = len(req_ids)
    _step(runner, decode)
    _finish(runner, req_ids)


def warm_up(runner: AccelModelRunner,
            before_top_k_top_p: Callable[[], None] = lambda: None) -> None:
    """Compile and run every token bucket, smallest first (the largest samples
    with top-k/top-p, after ``before_top_k_top_p``); log parseable totals."""
    stats = runner.compile_stats
    buckets = runner.token_buckets
    started = time.perf_counter()
    for index, bucket in enumerate(buckets):
        bucket_start = time.perf_counter()
        sampling = _SAMPLING[index == len(buckets) - 1]
        if sampling.top_k > 0:
            before_top_k_top_p()
        _run_bucket(runner, bucket, sampling)
        logger.info(
            "vllm_accel warmup: bucket %d/%d (%d tokens) in %.1f s",
            index + 1, len(buckets), bucket, time.perf_counter() - bucket_start,
        )
    vision = runner.vision
    if vision is not None:
        # Real images through the model's own processor, one per image bucket
        # (then packed copies for the buckets past the largest image).
        encoder = runner.vision_encoder
        encoder_start = time.perf_counter()
        sizes = vision.warmup_image_sizes(encoder.image_buckets)
        # Each bucket's layer graphs load (or compile) in the tower's first
        # layers; the rest pass their input on (model/compile.py).
        with set_forward_context(runner.forward_context(warming_up=True)):
            for group in encoder.warmup_groups(vision.warmup_items(sizes)):
                encoder.encode(group)
        logger.info(
            "vllm_accel warmup: vision encoder, %d image sizes %s, buckets %s in %.1f s",
            len(sizes), sizes, encoder.buckets, time.perf_counter() - encoder_start,
        )
    stats.finish_warmup()
    hits, misses = stats.cache_hits
    logger.info(
        "vllm_accel warmup finished in %.1f s: %d graphs (compile cache hits %d, misses %d, "
        "bypasses %d)", time.perf_counter() - started, stats.warmup_graphs, hits, misses,
        stats.cache_bypasses,
    )


def _timed_runs(bucket: int) -> int:
    """How many times a bucket's forward is timed (the fastest counts): small
    forwards are short and noisy, large ones cost start-up time. A fixed
    number, not a time budget: under tensor parallelism every rank must run
    the same forwards."""
    return 3 if bucket <= 64 else 2


def _forward_seconds(runner: AccelModelRunner, bucket: int, context: int) -> float:
    """The fastest of a few forwards of ``bucket`` tokens: prompts as long
    as the model's context allows, each going on after ``context`` tokens
    already in the KV cache (as far as max_model_len leaves room)."""
    room = runner.max_model_len - 2
    context = max(0, min(context, room - bucket))
    num_prompts = -(-bucket // (room - context))
    lengths = _prompt_lengths(bucket, room - context, num_prompts)
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    runner.forward_times = {}
    try:
        for run in range(_timed_runs(bucket)):
            prefill = _new_requests(runner, f"timing-{bucket}-{run}", lengths, greedy, context)
            _step(runner, prefill)
            _finish(runner, list(prefill.num_scheduled_tokens))
        return min(runner.forward_times[bucket])
    finally:
        runner.forward_times = None


def measure_forward_costs(runner: AccelModelRunner) -> None:
    """Time each token bucket's forward, as a step's first (new prompts) and
    as a later one (a prompt going on after a forward of the largest bucket),
    and cut steps into forwards by those times from now on. Under tensor
    parallelism every rank takes the driver's times: all ranks must cut a
    step the same way."""
    started = time.perf_counter()
    buckets = runner.token_buckets
    first = [_forward_seconds(runner, b, 0) for b in buckets]
    later = [_forward_seconds(runner, b, buckets[-1]) for b in buckets]
    if runner.tp_size > 1:
        first, later = get_tp_group().broadcast_object((first, later), src=0)
    runner.forward_costs = ForwardCosts.measured(first, later)

    def listed(seconds):
        return " ".join(f"{b}={t * 1e3:.2f}" for b, t in zip(buckets, seconds))

    runs = sorted({_timed_runs(b) for b in buckets})
    logger.info(
        "vllm_accel forward times by token bucket (ms, fastest of %s runs): first %s; "
        "later %s; measured in %.1f s", "-".join(map(str, runs)),
        listed(first), listed(later), time.perf_counter() - started,
    )
