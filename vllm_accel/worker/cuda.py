"""The cuda device's start-up work for the runner: the memory profile that
sizes the KV cache, capturing the CUDA graphs of its forwards
(cuda_graphs.py), and compiling vLLM's Triton sampling kernels before serving.
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.triton_utils import HAS_TRITON
from vllm.utils.jit_monitor import activate as activate_jit_monitor

from vllm_accel.log import get_logger
from vllm_accel.model.paged_attention import TableShape
from vllm_accel.worker.cuda_graphs import ForwardGraphs
from vllm_accel.worker.in_flight import NO_TOKENS_IN_FLIGHT
from vllm_accel.worker.kv_cache import allocate_kv_caches
from vllm_accel.worker.step_layout import StepLayout, pack_step

if TYPE_CHECKING:
    from vllm_accel.worker.model_runner import AccelModelRunner

logger = get_logger(__name__)


def dummy_embeddings(runner: AccelModelRunner, bucket: int) -> torch.Tensor:
    """Zero embeddings of a forward of ``bucket`` tokens: a vision model
    always runs on embeddings, computed before the forward."""
    width = runner.vision.embedding_width(runner.model.hidden_size)
    return torch.zeros(1, bucket, width, dtype=runner.dtype, device=runner.device)


def prefill_filling(bucket: int, max_model_len: int, block_size: int,
                    table_shape: TableShape) -> tuple[StepLayout, int]:
    """One forward of prompts that fill ``bucket`` tokens, and the KV blocks
    it writes (block 0 included, never a request's). No prompt is longer than
    the model's context: a longer one would read rotary positions the model
    does not have (a token bucket may be larger than max_model_len)."""
    full, rest = divmod(bucket, max_model_len)
    lengths = np.array([max_model_len] * full + [rest] * (rest > 0))
    blocks = -(-lengths // block_size)
    first = np.cumsum(blocks) - blocks + 1  # each prompt in blocks of its own
    block_table = np.zeros((len(lengths), table_shape.width), dtype=np.int32)
    for row, (lo, count) in enumerate(zip(first, blocks)):
        block_table[row, :count] = np.arange(lo, lo + count)
    token_ids = np.zeros((len(lengths), max_model_len), dtype=np.int64)
    step = pack_step(token_ids, block_table, lengths, np.zeros_like(lengths), block_size,
                     lambda tokens: [bucket], lambda width: width, None, table_shape)
    return step, block_table, int(blocks.sum()) + 1


def _profile_caches(runner: AccelModelRunner, num_blocks: int) -> list[tuple]:
    """A KV cache of ``num_blocks`` blocks a layer for the profile; a layer
    that keeps recurrent state gets its pages as bytes (a state fits in an
    attention block's page: config_checks.configure_recurrent_state), all
    such layers in one recurrent group."""
    model = runner.model
    caches = allocate_kv_caches(model.num_layers, num_blocks, runner.block_size,
                                model.num_kv_heads, model.head_dim, runner.dtype, runner.device)
    group = torch.zeros(1, dtype=torch.int64, device=runner.device)
    for layer in model.recurrent:
        caches[layer] = (*(t.view(torch.uint8).view(num_blocks, -1) for t in caches[layer]),
                         group)
    return caches


def profile_peak_memory(runner: AccelModelRunner) -> int:
    """Bytes a prefill forward of the largest token bucket allocates beyond
    what is held before it (its activations), with a KV cache of just the
    blocks it needs; the memory is freed again."""
    bucket, bs, model, device = runner.token_buckets[-1], runner.block_size, runner.model, \
        runner.device
    step, block_table, num_blocks = prefill_filling(bucket, runner.max_model_len, bs,
                                                    runner.table_shape)
    kv_caches = _profile_caches(runner, num_blocks)
    forward = step.forwards[0]
    # Each prompt's state in its first block (models that keep one).
    recurrent = forward.recurrent_layout([block_table]) if model.recurrent else None
    staged = runner.forward_inputs[bucket]
    sent = staged.send(forward, NO_TOKENS_IN_FLIGHT)
    # A vision model runs on embeddings (computed before the forward).
    inputs = sent.input_ids if runner.vision is None else dummy_embeddings(runner, bucket)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    serving_caches, runner.kv_cache.layers = runner.kv_cache.layers, kv_caches
    try:
        with torch.inference_mode():
            runner.model_call(inputs, sent.positions, sent.metadata, sent.logit_rows,
                              recurrent=recurrent)
    finally:
        runner.kv_cache.layers = serving_caches
    peak = torch.cuda.max_memory_allocated(device) - before
    del kv_caches
    torch.cuda.empty_cache()
    return peak


def graph_buckets(runner: AccelModelRunner) -> list[int]:
    """The token buckets that get a CUDA graph: all, or for a model with
    recurrent layers (graphs of decodes only) those up to the first that
    holds a decode of every request."""
    buckets = runner.token_buckets
    if runner.model.recurrent:
        buckets = buckets[: bisect.bisect_left(buckets, runner.max_num_reqs) + 1]
    return buckets


@torch.inference_mode()
def capture_graphs(runner: AccelModelRunner) -> ForwardGraphs:
    """A graph per token bucket (``graph_buckets``), after warmup compiled
    every bucket."""
    graphs = ForwardGraphs()
    for bucket in graph_buckets(runner):
        staged = runner.forward_inputs[bucket]
        # A vision model runs on embeddings, computed before the graph.
        inputs = staged.input_ids if runner.vision is None \
            else dummy_embeddings(runner, bucket)
        graphs.capture(bucket, inputs, staged, runner.model_call)
    runner.compile_stats.after_step("capturing CUDA graphs")
    return graphs


def _sampling_dispatchers():
    """vLLM's Triton top-k/top-p kernels: the monolithic one and the split
    top-p pipeline's three."""
    from vllm.v1.sample.ops import topk_topp_triton as ops

    return (ops._topk_topp, ops._topp_split_stats, ops._topp_split_step, ops._topp_split_mask)


def _compiled_keys(dispatchers) -> set[tuple[str, str]]:
    """The Triton variants the sampling kernels hold compiled, on every device."""
    return {(d.kernel.__name__, str(key)) for d in dispatchers
            for caches in getattr(d.kernel, "device_caches", {}).values() for key in caches[0]}


def _with_row_stride(key, aligned: bool) -> bool:
    """Whether a warmup key's logits have rows as ours do: a row stride that
    is a multiple of 16 (Triton specializes on it) or not."""
    logits = dict(key.inputs).get("logits")
    return not hasattr(logits, "stride") or (logits.stride(0) % 16 == 0) == aligned


def start_compilers_early() -> None:
    """Start, beside the model's load, what inductor's first compile (the
    memory profile's) would start and then wait for: its pool of compile
    workers (until the pool is ready, kernels compile one by one on the
    compiling thread) and the hash of Triton's install, its compile cache's
    key (every Triton file and library read: up to 3.7 s on a cold H100
    start's compiling thread, and again on the sampling kernels' thread;
    benchmarks/README.md)."""
    if not HAS_TRITON:
        return
    from torch._inductor.async_compile import maybe_warm_pool  # torch's own warm-up
    from torch._inductor.runtime.triton_compat import triton_key  # cached once computed

    threading.Thread(target=triton_key, name="vllm_accel-triton-key", daemon=True).start()
    maybe_warm_pool()


class SamplingKernelsAhead:
    """The variants vLLM's warmup registry declares for its sampling kernels
    (it only does so on vLLM's own cuda platform), compiled on a thread that
    starts when the model is loaded, so their compile (CPU) overlaps the
    memory profile and whatever else runs before ``wait``. The thread
    compiles on vLLM's pool (``compile_triton_warmup``:
    VLLM_TRITON_JIT_WARMUP_NUM_THREADS threads) with fake tensors: it launches
    nothing and allocates no device memory. Nothing may sample before
    ``wait`` returns (the kernels' dispatchers are not thread-safe). Its keys
    cover both kinds of row stride; our logits (contiguous, ``logits_width``
    wide) have one."""

    def __init__(self, runner: AccelModelRunner, vllm_config: VllmConfig):
        self.seconds = 0.0  # the compile's own time, set by the thread
        self.waited = 0.0  # start-up time spent waiting for it
        self.variants = 0
        self._thread = threading.Thread(
            target=self._compile,
            args=(vllm_config, runner.model.logits_width, torch.cuda.current_device()),
            name="vllm_accel-sampling-kernels", daemon=True)
        self._thread.start()

    def _compile(self, vllm_config: VllmConfig, logits_width: int, device: int) -> None:
        from vllm.model_executor.warmup.jit_warmup_triton_helper import compile_triton_warmup

        started = time.perf_counter()
        dispatchers = _sampling_dispatchers()
        aligned = logits_width % 16 == 0
        try:
            torch.cuda.set_device(device)  # the worker's; a thread has its own current device
            keys = [(d, [k for k in d.get_warmup_keys(vllm_config=vllm_config)
                         if _with_row_stride(k, aligned)]) for d in dispatchers]
            compile_triton_warmup(lambda: [d.compile_many(k) for d, k in keys],
                                  sum(len(k) for _, k in keys))
        except Exception as error:  # vLLM's registry off its own platform: the runs still compile
            logger.warning("vllm_accel could not compile the sampling kernels ahead (%s); "
                           "they compile one by one", error)
        self.variants = len(_compiled_keys(dispatchers))
        self.seconds = time.perf_counter() - started

    def wait(self) -> None:
        started = time.perf_counter()
        self._thread.join()
        self.waited += time.perf_counter() - started


def start_sampling_kernels_ahead(runner: AccelModelRunner,
                                 vllm_config: VllmConfig) -> SamplingKernelsAhead | None:
    """``SamplingKernelsAhead`` for a model that samples with Triton."""
    if not HAS_TRITON or runner.model is None or runner.pooling is not None:
        return None  # no Triton, or a pooling model: nothing is sampled
    return SamplingKernelsAhead(runner, vllm_config)


@torch.inference_mode()
def compile_sampling_kernels(runner: AccelModelRunner, vllm_config: VllmConfig,
                             ahead: SamplingKernelsAhead) -> None:
    """Compile vLLM's Triton top-k/top-p masking for every variant serving
    can ask for, so no request waits on its JIT compile: first the variants
    compiled ahead (``SamplingKernelsAhead``, waited for), then by running
    each case once, which compiles any variant the keys miss: top-k, top-p and
    both; batch 1 apart; and top-p alone at up to 64 requests splits each row
    by the batch size (a variant per split count; above 64 one variant serves
    every batch size, run at max_num_seqs). Then vLLM's JIT monitor reports
    any later compile (--jit-monitor-mode)."""
    from vllm.v1.sample.ops import topk_topp_triton as ops

    ahead.wait()
    started = time.perf_counter()
    dispatchers = _sampling_dispatchers()
    compiled_ahead = _compiled_keys(dispatchers)
    batch_sizes = sorted({*range(1, min(runner.max_num_reqs, ops._SPLIT_MAX_BATCH) + 1),
                          runner.max_num_reqs})
    for n in batch_sizes:
        logits = torch.randn(n, runner.model.logits_width, device=runner.device)
        k = torch.full((n,), 5, dtype=torch.int32, device=runner.device)
        p = torch.full((n,), 0.9, device=runner.device)
        for top_k, top_p in ((k, None), (None, p), (k, p)):
            ops.apply_top_k_top_p_triton(logits.clone(), top_k, top_p)
    torch.cuda.synchronize(runner.device)
    runs_s = time.perf_counter() - started
    by_runs = sorted(_compiled_keys(dispatchers) - compiled_ahead)
    logger.info("vllm_accel sampling kernels compiled for batch sizes 1-%d in %.1f s: "
                "%d variants ahead in %.1f s on a thread (%.1f s waited for), %d more by the "
                "runs in %.1f s", runner.max_num_reqs, ahead.waited + runs_s, ahead.variants,
                ahead.seconds, ahead.waited, len(by_runs), runs_s)
    if by_runs:  # variants vLLM's warmup keys miss
        logger.info("vllm_accel sampling kernel variants compiled by the runs: %s",
                    "; ".join(f"{name} {key}" for name, key in by_runs))
    observability = vllm_config.observability_config
    activate_jit_monitor(mode=observability.jit_monitor_mode,
                         verbose=observability.jit_monitor_verbose)
