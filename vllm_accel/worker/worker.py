"""The worker: the process-side object vLLM's executor drives.

It owns the device set-up, the KV memory budget and one model runner, and
forwards each engine step to it. vLLM calls, in order: ``init_device``,
``load_model``, ``get_kv_cache_spec``, ``determine_available_memory``,
``initialize_from_config``, ``compile_or_warm_up_model``, then
``execute_model``/``sample_tokens`` per step.
"""

from __future__ import annotations

import gc
import os
import time

import torch
from vllm.config import VllmConfig
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm_accel.log import get_logger
from vllm.utils.torch_utils import (
    OMP_NUM_THREADS_SET_BY_VLLM,
    available_cpu_count,
    set_random_seed,
)
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from vllm_accel.devices import check_dtype, select_backend
from vllm_accel.platform import AccelPlatform
from vllm_accel.patches import (
    compile_tuning_candidates_ahead,
    exact_float32_dots,
    keep_large_buffers_mapped,
    overlap_kernel_launches,
    probe_cpu_vector_isa,
    reuse_tuned_block_sizes,
    set_worker_threads,
    tune_gpu_reductions,
)
from vllm_accel.settings import env_var_name, load_settings
from vllm_accel.worker.cuda import (
    capture_graphs,
    compile_sampling_kernels,
    profile_peak_memory,
    start_compilers_early,
    start_sampling_kernels_ahead,
)
from vllm_accel.worker.model_runner import AccelModelRunner
from vllm_accel.worker.warmup import measure_forward_costs, warm_up

logger = get_logger(__name__)


def worker_threads(setting: int, local_workers: int) -> int:
    """Torch threads for one worker (0: leave torch's default).

    The setting wins. With one worker, torch's default (the machine's cores).
    With several on this machine (tensor parallelism), each gets an equal share
    of the cores this process may use, so that they do not oversubscribe them
    (vLLM's multiprocessing executor passes the same share to its workers in
    OMP_NUM_THREADS, unless the user set that variable, which then wins)."""
    if setting:
        return setting
    users_omp = ("OMP_NUM_THREADS" in os.environ
                 and os.environ.get(OMP_NUM_THREADS_SET_BY_VLLM) != "1")
    if local_workers <= 1 or users_omp:
        return 0
    return max(1, available_cpu_count() // local_workers)


class AccelWorker(WorkerBase):
    def __init__(
        self,
        vllm_config: VllmConfig,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
    ):
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        self.settings = load_settings(vllm_config.additional_config)
        self.backend = select_backend(self.settings)
        AccelPlatform.worker_device = self.backend.device  # patches.py, 21
        self.model_runner: AccelModelRunner | None = None
        self.startup_s: dict[str, float] = {}  # start-up phases, seconds, for the log
        self.sampling_kernels_ahead = None  # cuda: compiling from load_model on (cuda.py)

    # ---- start-up -----------------------------------------------------------

    def init_device(self) -> None:
        self.device = torch.device(self.backend.device)
        if self.backend.device == "cuda":
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
            # What an engine shut down earlier in this process left in torch's
            # allocator cache is free too: hand it back before measuring.
            gc.collect()
            torch.cuda.empty_cache()
            self.free_at_start, self.total_memory = torch.cuda.mem_get_info()
            self._check_gpu_memory_utilization()
            if self.model_config.dtype == torch.float32:
                exact_float32_dots()  # attention's Triton kernel (patches.py, 12)
        check_dtype(self.backend.device, self.model_config.dtype)
        parallel = self.parallel_config
        # Torch threads, and inductor's kernel builds on them (patches.py, 5).
        inductor = self.backend.compile_backend == "inductor"
        set_worker_threads(worker_threads(self.settings.num_threads, parallel.local_world_size),
                           inductor=inductor)
        if self.backend.device == "cpu":
            keep_large_buffers_mapped()  # patches.py, 14
        if inductor and self.backend.device == "cpu":
            probe_cpu_vector_isa()  # outside the compile cache (patches.py, 13)
        if inductor and self.backend.device == "cuda":
            tune_gpu_reductions()  # one-row matmuls as tuned reductions (patches.py, 18)
            reuse_tuned_block_sizes()  # a warm start does not tune again (patches.py, 19)
            compile_tuning_candidates_ahead()  # the tuning's compiles side by side (23)
            # Programmatic dependent launch (patches.py, 22).
            overlap_kernel_launches(torch.cuda.get_device_capability(self.device))
            start_compilers_early()  # compile workers, Triton's hash (cuda.py)
        logger.info(
            "vllm-accel worker (rank %d of %d) on device backend '%s', compile backend "
            "'%s', %d torch threads",
            self.rank,
            parallel.world_size,
            self.backend.device,
            self.backend.compile_backend,
            torch.get_num_threads(),
        )
        init_distributed_environment(
            world_size=parallel.world_size,
            rank=self.rank,
            distributed_init_method=self.distributed_init_method,
            local_rank=self.local_rank,
            backend=self.backend.dist_backend,
        )
        ensure_model_parallel_initialized(
            parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        )
        set_random_seed(self.model_config.seed)
        self.model_runner = AccelModelRunner(self.vllm_config, self.backend, self.settings,
                                             is_driver=self.is_driver_worker)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        started = time.perf_counter()
        self.model_runner.load_model()
        self.startup_s["model load"] = time.perf_counter() - started
        if self.backend.device == "cuda":
            self.sampling_kernels_ahead = start_sampling_kernels_ahead(self.model_runner,
                                                                       self.vllm_config)

    def get_model(self) -> torch.nn.Module:
        return self.model_runner.model

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return self.model_runner.get_kv_cache_spec()

    def get_supported_kv_cache_layouts(self) -> list[str]:
        # Each layer's cache is [blocks, tokens per block, kv heads, head dim].
        return [KVCacheLayout.LBNHC.name]

    def _check_gpu_memory_utilization(self) -> None:
        requested = self.cache_config.gpu_memory_utilization * self.total_memory
        if self.free_at_start < requested:
            raise ValueError(
                f"Free memory on {self.device} ({self.free_at_start / 2**30:.2f} GiB) is less "
                f"than --gpu-memory-utilization={self.cache_config.gpu_memory_utilization} of "
                f"its {self.total_memory / 2**30:.2f} GiB: lower it, or free the device.")

    def determine_available_memory(self) -> int:
        """The KV cache budget: on cuda, as vLLM's GPU worker sizes it, the
        share ``--gpu-memory-utilization`` of the device minus what this worker
        took since it started (weights, workspaces) and the peak of a forward
        of the largest token bucket (CUDA graphs, captured later, take theirs
        from what is left); elsewhere the ``kvcache_space`` setting. Checked
        against one full-length sequence, so a too-small budget fails here.
        Its time counts as the KV cache's in the start-up line (on a cold cuda
        start, the profile's forward compiles the largest bucket's graph)."""
        started = time.perf_counter()
        if self.backend.device == "cuda":
            budget, name = self._gpu_kv_budget(), "--gpu-memory-utilization"
            setting = (f"{name}={self.cache_config.gpu_memory_utilization} "
                       f"({budget / 2**30:.3f} GiB left for it)")
        else:
            budget, name = int(self.settings.kvcache_space * 2**30), env_var_name("kvcache_space")
            setting = f"{name}={self.settings.kvcache_space} GiB"
        needed = self.model_runner.kv_cache_bytes_per_token() * self.model_config.max_model_len
        if budget < needed:
            raise ValueError(
                f"The KV cache budget {setting} is too small for one sequence of "
                f"max_model_len={self.model_config.max_model_len} tokens, which needs "
                f"{needed / 2**30:.3f} GiB. Raise {name} or lower --max-model-len."
            )
        self.startup_s["KV cache"] = time.perf_counter() - started
        return budget

    def _gpu_kv_budget(self) -> int:
        peak = profile_peak_memory(self.model_runner)
        free_now, _ = torch.cuda.mem_get_info()
        used = self.free_at_start - free_now + peak  # weights, workspaces, the forward's peak
        budget = int(self.cache_config.gpu_memory_utilization * self.total_memory - used)
        logger.info(
            "vllm_accel GPU memory: %.2f GiB total, %.2f GiB used before start, %.2f GiB by "
            "the model and a forward's peak: %.2f GiB for the KV cache",
            self.total_memory / 2**30, (self.total_memory - self.free_at_start) / 2**30,
            used / 2**30, max(budget, 0) / 2**30)
        return max(budget, 0)

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        started = time.perf_counter()
        self.model_runner.initialize_kv_cache(kv_cache_config)
        self.startup_s["KV cache"] = (self.startup_s.get("KV cache", 0.0)
                                      + time.perf_counter() - started)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        started = time.perf_counter()
        # Nothing samples before the sampling kernels' ahead compile is done.
        ahead = self.sampling_kernels_ahead
        wait_for_sampling_kernels = ahead.wait if ahead is not None else lambda: None
        if self.settings.skip_warmup:
            logger.warning(
                "%s is set: each of the %d token buckets compiles on first use, so "
                "early requests wait for compilation.",
                env_var_name("skip_warmup"), len(self.model_runner.token_buckets),
            )
            wait_for_sampling_kernels()
        else:
            warm_up(self.model_runner, before_top_k_top_p=wait_for_sampling_kernels)
            # An encoder's forwards run outside CUDA graphs (no KV cache, few steps).
            graphs = (self.backend.device == "cuda" and self.settings.cuda_graphs
                      and self.model_runner.encoder is None)
            if graphs:
                captured = time.perf_counter()
                self.model_runner.graphs = capture_graphs(self.model_runner)
                # Recurrent layers: graphs of decodes only (worker/cuda_graphs.py).
                logger.info("vllm_accel captured %d CUDA graphs (token buckets %s, %s) in %.1f s",
                            len(self.model_runner.graphs.graphs),
                            list(self.model_runner.graphs.graphs),
                            "decodes only" if self.model_runner.model.recurrent
                            else "any forward", time.perf_counter() - captured)
            if self.settings.forward_plan == "measured":  # opt-in: see settings.py
                measure_forward_costs(self.model_runner)
            if ahead is not None:
                compile_sampling_kernels(self.model_runner, self.vllm_config, ahead)
        # Warmup sampled with seeds: start serving from the configured seed.
        set_random_seed(self.model_config.seed)
        warmup_s = time.perf_counter() - started
        stats = self.model_runner.compile_stats
        logger.info(
            "vllm_accel start-up: model load %.1f s, KV cache %.1f s, warmup %.1f s "
            "(%d graphs, %d from the compile cache), %d kernel tuning benchmarks",
            self.startup_s.get("model load", 0.0), self.startup_s.get("KV cache", 0.0),
            warmup_s, stats.warmup_graphs, stats.cache_hits[0], stats.tuning_benchmarks,
        )
        return CompilationTimes(language_model=warmup_s, encoder=0.0)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return self.model_runner.supported_tasks()

    def get_cache_block_size_bytes(self) -> int:
        return self.model_runner.kv_cache_bytes_per_token() * self.cache_config.block_size

    # ---- per step -----------------------------------------------------------

    def execute_model(self, scheduler_output):
        return self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output):
        return self.model_runner.sample_tokens(grammar_output)

    def update_max_model_len(self, max_model_len: int) -> None:
        self.model_config.max_model_len = max_model_len

    def reset_encoder_cache(self) -> None:
        self.model_runner.reset_encoder_cache()

    def check_health(self) -> None:
        pass

    def runner_state(self) -> dict[str, int]:
        """Sizes of the runner's per-request and per-image state, and its
        counters: what a soak test checks once the server is idle.
        Read-only; reachable as ``collective_rpc("runner_state")`` (with
        ``VLLM_SERVER_DEV_MODE=1``, ``POST /collective_rpc`` of `vllm serve`)."""
        runner = self.model_runner
        return {
            **runner.requests.sizes(),
            **(runner.images.sizes() if runner.images is not None
               else {"encoder_cache_entries": 0, "encoder_cache_rows": 0}),
            "encoder_cache_capacity": self.vllm_config.scheduler_config.encoder_cache_size,
            "runtime_compiles": runner.compile_stats.runtime_compiles,
            # decode inputs taken from the device (async scheduling)
            "tokens_from_device": runner.tokens_from_device,
        }

    def shutdown(self) -> None:
        self.model_runner = None
        if self.backend.device == "cuda":
            # Give the KV cache, weights and graph pools back to the device,
            # not just to torch's allocator: another engine may start here.
            gc.collect()
            torch.cuda.empty_cache()

