"""Patches 18, 19 and 22: inductor's block-size tuning and its kernels'
launches on cuda (``patches.py`` lists every patch and says why; it
re-exports these)."""

from __future__ import annotations

import contextlib
import os

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


def reuse_tuned_block_sizes() -> None:
    """Patch 19."""
    import torch
    from torch._inductor.runtime import triton_heuristics

    if torch.torch_version.TorchVersion(torch.__version__) < "2.12":
        triton_heuristics.CachingAutotuner.recheck_autotune_cache = recheck_autotune_cache


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
