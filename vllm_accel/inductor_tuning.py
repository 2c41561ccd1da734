"""Patches 18, 19, 22 and 23: inductor's block-size tuning and its kernels'
launches on cuda (``patches.py`` lists every patch and says why; it
re-exports these)."""

from __future__ import annotations

import contextlib
import copy
import os
from concurrent.futures import ThreadPoolExecutor

_COORDINATE_DESCENT_ENV = "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING"
_PDL_ENV = "TORCHINDUCTOR_ENABLE_PDL"


def tune_gpu_reductions() -> None:
    """Patch 18."""
    if _COORDINATE_DESCENT_ENV not in os.environ:
        import torch._inductor.config

        torch._inductor.config.coordinate_descent_tuning = True


def overlap_kernel_launches(capability: tuple[int, int]) -> None:
    """Patch 22, for a GPU of compute ``capability``."""
    if _PDL_ENV not in os.environ and capability >= (9, 0):
        import torch._inductor.config

        torch._inductor.config.triton.enable_pdl = True


def shared_graph_compile():
    """Patch 18's exception: the compile of a graph that serves every bucket
    above 1 (model/compile.py), without coordinate-descent tuning."""
    if _COORDINATE_DESCENT_ENV in os.environ:
        return contextlib.nullcontext()
    import torch._inductor.config

    return torch._inductor.config.patch(coordinate_descent_tuning=False)


_TUNED_MARK = "found_by_coordesc"  # inductor's mark on a config coordinate descent chose
_triton_config_setstate = None  # Triton's Config.__setstate__, under patch 19's


def reuse_tuned_block_sizes() -> None:
    """Patch 19."""
    global _triton_config_setstate
    import torch
    from torch._inductor.runtime import triton_heuristics
    from triton import Config

    if torch.torch_version.TorchVersion(torch.__version__) < "2.12":
        triton_heuristics.CachingAutotuner.recheck_autotune_cache = recheck_autotune_cache
    if "__setstate__" in vars(Config) and Config.__setstate__ is not config_setstate_keeping_mark:
        _triton_config_setstate = Config.__setstate__
        Config.__setstate__ = config_setstate_keeping_mark


def config_setstate_keeping_mark(self, state: dict) -> None:
    """Patch 19's ``triton.Config.__setstate__``: Triton's, which sets only
    the fields it knows, and inductor's tuned mark if the pickled config had it."""
    _triton_config_setstate(self, state)
    if state.get(_TUNED_MARK):
        setattr(self, _TUNED_MARK, True)


def recheck_autotune_cache(self, reload_kernel_from_src) -> None:
    """Patch 19's ``CachingAutotuner.recheck_autotune_cache``: the cached
    best config taken with its mark of coordinate-descent tuning."""
    from torch._inductor.runtime.triton_heuristics import (check_autotune_cache,
                                                          triton_config_to_hashable)

    configs = [result.config for result in self.compile_results]
    cached, _, self.autotune_cache_info = check_autotune_cache(
        configs, self.filename, self.inductor_meta)
    if len(cached) != 1:
        return  # several configs, none cached: autotuned at the first launch
    best = cached[0]
    tuned = getattr(best, "found_by_coordesc", False)
    for result in self.compile_results:
        if triton_config_to_hashable(result.config) == triton_config_to_hashable(best):
            result.config.found_by_coordesc = tuned  # the mark torch 2.11 drops
            self.compile_results = [result]
            return
    if tuned:  # tuned to a config this cache entry never compiled
        if self.fn.fn is None:  # dropped when the kernel was cached
            self.fn = reload_kernel_from_src().fn
        self.compile_results = [self._precompile_config(best)]


_torch_coordinate_descent = None  # torch's coordinate_descent_tuning, under patch 23's


def compile_tuning_candidates_ahead() -> None:
    """Patch 23."""
    global _torch_coordinate_descent
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    if CachingAutotuner.coordinate_descent_tuning is not coordinate_descent_compiling_ahead:
        _torch_coordinate_descent = CachingAutotuner.coordinate_descent_tuning
        CachingAutotuner.coordinate_descent_tuning = coordinate_descent_compiling_ahead


def coordinate_descent_compiling_ahead(self, launcher, *args, **kwargs):
    """Patch 23's ``CachingAutotuner.coordinate_descent_tuning``: torch's,
    with its tuner's benchmark function wrapped by ``CandidatesAhead``."""
    tuner = self.coordesc_tuner
    # An instance attribute, for this call only, over the class's autotune.
    tuner.autotune = lambda benchmark, baseline, timing=None: type(tuner).autotune(
        tuner, CandidatesAhead(tuner, self._precompile_config, baseline, timing).wrap(benchmark),
        baseline, timing)
    try:
        return _torch_coordinate_descent(self, launcher, *args, **kwargs)
    finally:
        del tuner.autotune


class CandidatesAhead:
    """Coordinate descent benchmarks one candidate config at a time, each
    compiled first (Triton, ~0.2 s, on the tuning thread). Before a config it
    has not compiled is benchmarked, this compiles it together with every
    neighbour of the best config so far (the candidates the tuner tries next)
    on threads side by side; the benchmark's own compile then finds it in
    Triton's cache. Nothing compiles while a config is benchmarked, and the
    tuner's walk, its timings and its pick are its own."""

    def __init__(self, tuner, compile_config, baseline, baseline_timing=None):
        """A walk of ``tuner`` from ``baseline``, compiling with
        ``compile_config`` (the kernel's _precompile_config). The baseline's
        timing: given, or the one the tuner holds (inductor benchmarks a
        kernel's few heuristic configs first), or else its first benchmark's
        (the tuner benchmarks its baseline first)."""
        self.tuner = tuner
        self.compile_config = compile_config
        self.compiled: set = set()
        self.best = baseline
        self.best_timing = (baseline_timing if baseline_timing is not None
                            else tuner.lookup_in_cache(baseline))

    def wrap(self, benchmark):
        """``benchmark`` (the tuner's function of a config), compiling ahead."""

        def benchmark_compiled_ahead(config):
            self.compile_with_neighbours(config)
            timing = benchmark(config)
            # The tuner's own rule for a new best (its compare_config).
            if self.best_timing is None or self.tuner.has_improvement(self.best_timing, timing):
                self.best, self.best_timing = config, timing
            return timing

        return benchmark_compiled_ahead

    def compile_with_neighbours(self, config) -> None:
        import torch._inductor.config
        from torch._inductor.runtime.triton_heuristics import triton_config_to_hashable

        if triton_config_to_hashable(config) in self.compiled:
            return
        batch = {}
        for candidate in (config, *self.neighbours(self.best)):
            key = triton_config_to_hashable(candidate)
            if key not in self.compiled:
                batch.setdefault(key, candidate)
        self.compiled.update(batch)
        # Inductor's compile_threads: the worker's count (patch 5).
        threads = max(1, min(len(batch), torch._inductor.config.compile_threads))
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(self._compile, batch.values()))

    def neighbours(self, config) -> list:
        """The configs one step from ``config`` along each tunable field, as
        the tuner makes them (torch 2.11 and 2.13)."""
        from torch._inductor.runtime.coordinate_descent_tuner import get_field, set_field

        out = []
        for name in self.tuner.tunable_fields:
            value = get_field(config, name)
            if value is None:
                continue
            for step in self.tuner.get_neighbour_values(name, value):
                candidate = copy.deepcopy(config)
                set_field(candidate, name, step)
                if self.tuner.is_valid_config(candidate):
                    out.append(candidate)
        return out

    def _compile(self, config) -> None:
        try:
            self.compile_config(config)
        except Exception:  # noqa: BLE001 - the benchmark's own compile raises it for the tuner
            pass
