"""Process-wide patches (vllm_accel/patches.py) that leave the caller's state
as they found it, and the stand-in video processor's pickling."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch.utils import deterministic

from vllm_accel.patches import nan_for_unloaded_weights, torchvision_available, use_v1_model_runner


@pytest.fixture
def restore_deterministic_mode():
    state = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             deterministic.fill_uninitialized_memory)
    yield
    torch.use_deterministic_algorithms(state[0], warn_only=state[1])
    deterministic.fill_uninitialized_memory = state[2]


@pytest.mark.parametrize("enabled, warn_only", [(True, True), (True, False), (False, False)])
def test_nan_for_unloaded_weights_restores_deterministic_mode(
        restore_deterministic_mode, enabled, warn_only):
    """Patch 8 restores the caller's mode, warn_only included."""
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    with nan_for_unloaded_weights():
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.empty(4).isnan().all()
    assert torch.are_deterministic_algorithms_enabled() is enabled
    assert torch.is_deterministic_algorithms_warn_only_enabled() is warn_only


def test_use_v1_model_runner(monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    use_v1_model_runner()
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"


@pytest.mark.skipif(torchvision_available(), reason="the stand-in is for hosts without torchvision")
def test_video_stub_pickles_from_its_module():
    from vllm_accel.video_stub import Qwen2VLVideoProcessor

    assert Qwen2VLVideoProcessor.__module__ == "vllm_accel.video_stub"
    processor = Qwen2VLVideoProcessor(max_pixels=200704)
    copy = pickle.loads(pickle.dumps(processor))
    assert type(copy) is Qwen2VLVideoProcessor
    assert copy.size["longest_edge"] == 200704 and copy.merge_size == 2


def _kernel_loaded_from_cache(tmp_path, compiled, tuned=None):
    """A kernel as inductor's cache hands it back: its one compiled config,
    and (``tuned``) the coordinate-descent result of an earlier start, written
    by torch's own autotune cache beside the kernel's source."""
    from types import SimpleNamespace

    from torch._inductor.runtime.autotune_cache import AutotuneCache
    from torch._inductor.runtime.triton_heuristics import hash_configs

    filename = str(tmp_path / "triton_poi_fused_0.py")
    meta = {"coordinate_descent_tuning": True}
    if tuned is not None:
        cache = AutotuneCache.create(meta, filename, hash_configs([compiled]))
        cache.save(tuned, 0, found_by_coordesc=True)
    return SimpleNamespace(filename=filename, inductor_meta=meta, autotune_cache_info=None,
                           compile_results=[SimpleNamespace(config=compiled)],
                           fn=SimpleNamespace(fn=object()),
                           _precompile_config=lambda config: SimpleNamespace(config=config))


def test_a_cached_kernel_takes_its_tuned_config(tmp_path):
    """Patch 19 (torch 2.11's recheck, run here on this torch's cache code):
    a one-config kernel takes the block sizes tuned at an earlier start,
    marked as tuned, so the first launch does not tune it again."""
    from triton import Config

    from vllm_accel.patches import _recheck_taking_tuned_configs

    def torch_recheck(self, reload):
        raise AssertionError("torch's recheck handles kernels of several configs only")

    recheck = _recheck_taking_tuned_configs(torch_recheck)
    compiled = Config({"XBLOCK": 64}, num_warps=4, num_stages=1)
    kernel = _kernel_loaded_from_cache(tmp_path / "a", compiled,
                                       Config({"XBLOCK": 256}, num_warps=8, num_stages=1))
    recheck(kernel, None)
    (result,) = kernel.compile_results
    assert (result.config.kwargs, result.config.num_warps) == ({"XBLOCK": 256}, 8)
    assert result.config.found_by_coordesc
    assert kernel.autotune_cache_info["autotune_cache_state"] == "hit"

    # Tuning kept the compiled config: the compiled kernel stays, marked as tuned.
    kept = _kernel_loaded_from_cache(tmp_path / "b", compiled,
                                     Config({"XBLOCK": 64}, num_warps=4, num_stages=1))
    recheck(kept, None)
    assert kept.compile_results[0].config is compiled and compiled.found_by_coordesc

    # Nothing cached: left as torch leaves it (tuned at its first launch).
    fresh = Config({"XBLOCK": 32}, num_warps=2, num_stages=1)
    untuned = _kernel_loaded_from_cache(tmp_path / "c", fresh)
    recheck(untuned, None)
    assert untuned.compile_results[0].config is fresh
    assert not getattr(fresh, "found_by_coordesc", False)


def test_kernels_of_several_configs_and_newer_torch_keep_torchs_recheck(tmp_path):
    from triton import Config
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    from vllm_accel.patches import _recheck_taking_tuned_configs, reuse_tuned_block_sizes

    calls = []
    recheck = _recheck_taking_tuned_configs(lambda self, reload: calls.append(self))
    kernel = _kernel_loaded_from_cache(tmp_path, Config({"XBLOCK": 64}, num_warps=4))
    kernel.compile_results.append(kernel.compile_results[0])
    recheck(kernel, None)
    assert calls == [kernel]
    torchs = CachingAutotuner.recheck_autotune_cache
    reuse_tuned_block_sizes()
    if torch.torch_version.TorchVersion(torch.__version__) >= "2.12":
        assert CachingAutotuner.recheck_autotune_cache is torchs  # fixed there
    else:
        assert CachingAutotuner.recheck_autotune_cache.torch_recheck is torchs
        reuse_tuned_block_sizes()  # once only
        assert CachingAutotuner.recheck_autotune_cache.torch_recheck is torchs
