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
    """A kernel as inductor's cache hands it back: its compiled configs, and
    (``tuned``) the coordinate-descent result of an earlier start, written by
    torch's own autotune cache beside the kernel's source."""
    from types import SimpleNamespace

    from torch._inductor.runtime.autotune_cache import AutotuneCache
    from torch._inductor.runtime.triton_heuristics import hash_configs

    filename = str(tmp_path / "triton_poi_fused_0.py")
    meta = {"coordinate_descent_tuning": True}
    if tuned is not None:
        cache = AutotuneCache.create(meta, filename, hash_configs(compiled))
        cache.save(tuned, 0, found_by_coordesc=True)
    return SimpleNamespace(filename=filename, inductor_meta=meta, autotune_cache_info=None,
                           compile_results=[SimpleNamespace(config=c) for c in compiled],
                           fn=SimpleNamespace(fn=object()),
                           _precompile_config=lambda config: SimpleNamespace(config=config))


def test_a_cached_kernel_takes_its_tuned_config(tmp_path):
    """Patch 19 (for torch 2.11, run here on this torch's cache code): a
    kernel loaded from inductor's cache takes the config coordinate descent
    found at an earlier start, marked as tuned, so its first launch does not
    tune it again."""
    from triton import Config

    from vllm_accel.patches import recheck_autotune_cache

    compiled = Config({"XBLOCK": 64}, num_warps=4, num_stages=1)
    kernel = _kernel_loaded_from_cache(tmp_path / "a", [compiled],
                                       Config({"XBLOCK": 256}, num_warps=8, num_stages=1))
    recheck_autotune_cache(kernel, None)
    (result,) = kernel.compile_results
    assert (result.config.kwargs, result.config.num_warps) == ({"XBLOCK": 256}, 8)
    assert result.config.found_by_coordesc
    assert kernel.autotune_cache_info["autotune_cache_state"] == "hit"

    # Tuning kept a compiled config (of one, or of several): it stays, marked.
    for name, configs in (("b", [compiled]), ("c", [Config({"XBLOCK": 128}, num_warps=4),
                                                    compiled])):
        kept = _kernel_loaded_from_cache(tmp_path / name, configs,
                                         Config({"XBLOCK": 64}, num_warps=4, num_stages=1))
        compiled.found_by_coordesc = False
        recheck_autotune_cache(kept, None)
        assert [r.config for r in kept.compile_results] == [compiled]
        assert compiled.found_by_coordesc

    # Nothing cached: left as torch leaves it (tuned or autotuned at the first launch).
    for name, configs in (("d", [Config({"XBLOCK": 32}, num_warps=2)]),
                          ("e", [Config({"XBLOCK": 32}, num_warps=2), compiled])):
        untuned = _kernel_loaded_from_cache(tmp_path / name, configs)
        compiled.found_by_coordesc = False
        recheck_autotune_cache(untuned, None)
        assert [r.config for r in untuned.compile_results] == configs
        assert not any(getattr(c, "found_by_coordesc", False) for c in configs)


@pytest.fixture
def patch_19(monkeypatch):
    """Patch 19, undone after the test."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    from triton import Config

    from vllm_accel import inductor_tuning

    monkeypatch.setattr(CachingAutotuner, "recheck_autotune_cache",
                        CachingAutotuner.recheck_autotune_cache)
    monkeypatch.setattr(Config, "__setstate__", Config.__setstate__)
    monkeypatch.setattr(inductor_tuning, "_triton_config_setstate", None)
    return inductor_tuning.reuse_tuned_block_sizes


def test_the_recheck_is_replaced_on_torch_before_2_12_only(patch_19):
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    from vllm_accel.patches import recheck_autotune_cache

    patch_19()
    older = torch.torch_version.TorchVersion(torch.__version__) < "2.12"
    assert (CachingAutotuner.recheck_autotune_cache is recheck_autotune_cache) == older


def test_a_tuned_config_keeps_its_mark_back_from_a_compile_worker(patch_19):
    """Patch 19: inductor's compile workers send a kernel back pickled, its
    config the one the autotune cache holds, marked as tuned. Triton's
    Config unpickles only the fields it knows, so the parent's first launch
    would tune the kernel again (a warm start's 'kernel tuning benchmarks')."""
    import pickle

    from triton import Config

    tuned = Config({"XBLOCK": 8, "R0_BLOCK": 512}, num_warps=4, num_stages=1)
    tuned.found_by_coordesc = True
    untuned = Config({"XBLOCK": 8}, num_warps=2)
    assert not getattr(pickle.loads(pickle.dumps(tuned)), "found_by_coordesc", False)

    patch_19()
    back = pickle.loads(pickle.dumps(tuned))
    assert back.found_by_coordesc
    assert (back.kwargs, back.num_warps, back.num_stages) == (tuned.kwargs, 4, 1)
    assert not getattr(pickle.loads(pickle.dumps(untuned)), "found_by_coordesc", False)
    patch_19()  # once only: Triton's own stays underneath
    assert pickle.loads(pickle.dumps(tuned)).found_by_coordesc


@pytest.mark.parametrize("user_set,capability", [(None, (9, 0)), ("0", (9, 0)),
                                                 (None, (8, 0)), (None, (10, 0))])
def test_kernel_launches_overlap_unless_the_user_says(user_set, capability, monkeypatch):
    """Patch 22: inductor's programmatic dependent launch on a GPU of compute
    capability 9 or later, unless TORCHINDUCTOR_ENABLE_PDL is set (then
    torch's reading of it stands)."""
    from torch._inductor import config

    from vllm_accel.patches import overlap_kernel_launches

    if user_set is None:
        monkeypatch.delenv("TORCHINDUCTOR_ENABLE_PDL", raising=False)
    else:
        monkeypatch.setenv("TORCHINDUCTOR_ENABLE_PDL", user_set)
    with config.patch({"triton.enable_pdl": False}):
        overlap_kernel_launches(capability)
        assert config.triton.enable_pdl is (user_set is None and capability >= (9, 0))


def _tuning_problem():
    """A coordinate descent tuner, its baseline (a one-row product's reduction)
    and a benchmark whose timing has one best config, away from the baseline."""
    import math

    from torch._inductor.runtime.coordinate_descent_tuner import CoordescTuner
    from triton import Config

    def tuner():
        return CoordescTuner(size_hints={"x": 2048, "r0_": 4096}, inductor_meta={
            "warp_size": 32, "max_threads_per_block": 1024})

    def timing(config):
        x, r = config.kwargs["XBLOCK"], config.kwargs["R0_BLOCK"]
        return 1 + (math.log2(x) - 3) ** 2 + (math.log2(r) - 9) ** 2 + (
            math.log2(config.num_warps) - 2) ** 2

    return tuner, Config({"XBLOCK": 1, "R0_BLOCK": 2048}, num_warps=8, num_stages=1), timing


@pytest.mark.parametrize("baseline_timed", [False, True])
def test_tuning_candidates_compile_side_by_side_and_the_pick_stays(baseline_timed):
    """Patch 23: each config coordinate descent benchmarks was compiled
    before, in batches with its neighbours, none while a benchmark ran; the
    walk, its benchmarks and its pick are the tuner's own. ``baseline_timed``:
    inductor timed the baseline before (among a kernel's heuristic configs)."""
    import threading

    from torch._inductor.runtime.triton_heuristics import triton_config_to_hashable as key

    from vllm_accel.inductor_tuning import CandidatesAhead

    make_tuner, baseline, timing = _tuning_problem()

    def tuner_for_the_kernel():
        tuner = make_tuner()
        if baseline_timed:
            tuner.cache_benchmark_result(baseline, timing(baseline))
        return tuner

    alone: list = []
    best_alone = tuner_for_the_kernel().autotune(
        lambda c: alone.append(key(c)) or timing(c), baseline)

    events, benchmarking, threads = [], threading.Event(), set()

    def compile_config(config):
        assert not benchmarking.is_set(), "compiled while a config was benchmarked"
        threads.add(threading.current_thread().name)
        events.append(("compile", key(config)))

    def benchmark(config):
        benchmarking.set()
        events.append(("benchmark", key(config)))
        try:
            return timing(config)
        finally:
            benchmarking.clear()

    tuner = tuner_for_the_kernel()
    best = tuner.autotune(CandidatesAhead(tuner, compile_config, baseline).wrap(benchmark),
                          baseline)

    assert key(best) == key(best_alone) != key(baseline)
    benchmarked = [k for kind, k in events if kind == "benchmark"]
    assert benchmarked == alone and len(alone) > 8
    compiled = [k for kind, k in events if kind == "compile"]
    assert len(compiled) == len(set(compiled)), "a config compiled twice"
    for i, (kind, k) in enumerate(events):
        if kind == "benchmark":
            assert ("compile", k) in events[:i], f"{k} benchmarked before it was compiled"
    # Side by side: few batches, on threads other than the tuner's.
    batches = sum(1 for a, b in zip(events, events[1:]) if a[0] == "benchmark" and b[0] == "compile")
    assert batches + 1 < len(alone) // 2
    assert threading.current_thread().name not in threads


def test_the_tuners_benchmarks_compile_ahead_for_one_tuning_only(monkeypatch):
    """Patch 23's hook: inductor's kernel tunes through its tuner's autotune,
    which compiles candidates ahead for that call, then is the class's again."""
    import types

    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    from vllm_accel import inductor_tuning

    make_tuner, baseline, timing = _tuning_problem()
    compiled = []

    def torchs(self, launcher):  # torch's coordinate_descent_tuning, reduced to its call
        return self.coordesc_tuner.autotune(timing, launcher.config, None)

    monkeypatch.setattr(inductor_tuning, "_torch_coordinate_descent", torchs)
    kernel = types.SimpleNamespace(coordesc_tuner=make_tuner(), _precompile_config=compiled.append)
    best = inductor_tuning.coordinate_descent_compiling_ahead(
        kernel, types.SimpleNamespace(config=baseline))
    assert best.kwargs == {"XBLOCK": 8, "R0_BLOCK": 512} and best.num_warps == 4
    assert len(compiled) > 8 and "autotune" not in vars(kernel.coordesc_tuner)

    monkeypatch.setattr(inductor_tuning, "_torch_coordinate_descent", None)
    monkeypatch.setattr(CachingAutotuner, "coordinate_descent_tuning",
                        CachingAutotuner.coordinate_descent_tuning)
    inductor_tuning.compile_tuning_candidates_ahead()
    inductor_tuning.compile_tuning_candidates_ahead()  # once only
    assert (CachingAutotuner.coordinate_descent_tuning
            is inductor_tuning.coordinate_descent_compiling_ahead)
    assert inductor_tuning._torch_coordinate_descent not in (
        None, inductor_tuning.coordinate_descent_compiling_ahead)  # torch's, kept once


def test_a_cuda_worker_starts_the_compilers_before_its_first_compile(monkeypatch):
    """worker/cuda.py's start_compilers_early: inductor's compile-worker
    pool (torch's own warm-up, else at the first compile) and Triton's
    install hash (else computed on the compiling thread), on a thread."""
    import threading

    from torch._inductor import async_compile
    from torch._inductor.runtime import triton_compat

    from vllm_accel.worker import cuda

    warmed, hashed_on = [], []
    monkeypatch.setattr(cuda, "HAS_TRITON", True)  # vLLM's answer on a host with a GPU
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: warmed.append(True))
    monkeypatch.setattr(triton_compat, "triton_key",
                        lambda: hashed_on.append(threading.current_thread().name))
    cuda.start_compilers_early()
    for thread in threading.enumerate():
        if thread.name == "vllm_accel-triton-key":
            thread.join(10)
    assert warmed == [True] and hashed_on == ["vllm_accel-triton-key"]


@pytest.fixture
def vector_isa_probe(monkeypatch, tmp_path):
    """Inductor's vector-ISA probe as a new process meets it (its cache
    directory in tmp_path): each call of the returned function clears the
    probe's per-process caches, runs patch 13 and gives the codes inductor
    built and load-tested (recorded, each passing or ``failing``)."""
    from torch._inductor import config
    from torch._inductor import cpu_vec_isa as isas

    from vllm_accel.patches import _vector_isa_machine, probe_cpu_vector_isa

    machine = _vector_isa_machine()
    if machine is None or not machine["candidates"]:
        pytest.skip("inductor probes no vector ISA on this CPU")
    # The probe's answers, cached per process (and on the ISA objects themselves).
    caches = (isas.valid_vec_isa_list, isas.VecISA._VecISA__bool__impl,
              isas.VecAVX512.__bool__, isas.VecAVX512.is_avx512_bf16_supported,
              isas.VecAVX512VNNI.__bool__, isas.VecAMX.__bool__)
    states = [(isa, dict(isa.__dict__)) for isa in isas.supported_vec_isa_list]
    VecISA = isas.VecISA
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    users_choice = config.cpp.vec_isa_ok

    def new_process(failing=()):
        for cache in caches:
            cache.cache_clear()
        config.cpp.vec_isa_ok = None
        built = []
        monkeypatch.setattr(VecISA, "check_build", lambda self, code: built.append(
            (str(self), code)) or str(self) not in failing)
        probe_cpu_vector_isa()
        return [isa for isa, code in built if code == VecISA._avx_code]

    yield new_process
    config.cpp.vec_isa_ok = users_choice
    for cache in caches:  # later compiles probe for real
        cache.cache_clear()
    for isa, state in states:
        isa.__dict__.clear()
        isa.__dict__.update(state)


def test_the_vector_isa_probe_keeps_its_answer_for_the_next_start(vector_isa_probe, tmp_path):
    """Patch 13: a start after a probe that found every candidate good takes
    them without building and loading the test programs again (a Python
    process each); a probe that failed one, or another torch, probes again."""
    import json

    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    from vllm_accel.patches import _vector_isa_machine

    candidates = _vector_isa_machine()["candidates"]
    assert vector_isa_probe() == candidates  # the first start tests each
    assert config.cpp.vec_isa_ok is None
    record = tmp_path / "vllm_accel_vec_isa.json"
    assert json.loads(record.read_text())["good"] == candidates
    assert vector_isa_probe() == []  # the next takes them
    assert config.cpp.vec_isa_ok is True
    assert [str(isa) for isa in valid_vec_isa_list()] == candidates

    assert vector_isa_probe(failing=candidates[:1]) == []  # the record holds
    record.write_text(json.dumps({**json.loads(record.read_text()), "torch": ["2.0", "x"]}))
    assert vector_isa_probe(failing=candidates[:1]) == candidates  # another torch
    assert json.loads(record.read_text())["good"] == candidates[1:]
    assert vector_isa_probe() == candidates  # one failed: probed at each start
    assert config.cpp.vec_isa_ok is None


def test_vllm_inspects_model_classes_in_this_process_on_our_platform_only(monkeypatch, tmp_path):
    """Patch 20: vLLM's registry, finding no record of a model class, asks
    about it in a new Python process (16 s of a first start on 2 cores,
    benchmarks/README.md); on our platform the question is answered here.
    Another platform keeps vLLM's subprocess."""
    import types

    import vllm.model_executor.models.registry as registry
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    from vllm_accel.patches import apply_patches

    apply_patches()

    def no_subprocess(*args, **kwargs):
        raise AssertionError("a subprocess was started")

    monkeypatch.setattr(registry, "subprocess", types.SimpleNamespace(run=no_subprocess))
    assert type(vllm.platforms.current_platform).__module__ == "vllm_accel.platform"
    assert registry._run_in_subprocess(os.getpid) == os.getpid()
    # The registry's own path, with an empty record folder: answered and recorded.
    monkeypatch.setattr(registry._LazyRegisteredModel, "_get_cache_dir",
                        staticmethod(lambda: tmp_path))
    llama = registry._LazyRegisteredModel("vllm.model_executor.models.llama", "LlamaForCausalLM")
    info = llama.inspect_model_cls()
    assert info.is_text_generation_model and not info.supports_multimodal
    assert (tmp_path / llama._get_cache_filename()).exists()

    monkeypatch.setattr(vllm.platforms, "_current_platform", CpuPlatform())
    with pytest.raises(AssertionError, match="a subprocess was started"):
        registry._run_in_subprocess(os.getpid)
