"""Device-backend selection (Gaudi faked: none here) and bucket arithmetic."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest

from vllm_accel.buckets import (
    exponential_buckets,
    find_bucket,
    half_octave_buckets,
    linear_buckets,
    make_buckets,
    thin_buckets,
    token_buckets,
)
from vllm_accel.devices import DeviceBackend, select_backend
from vllm_accel.settings import load_settings


@pytest.fixture(autouse=True)
def default_settings(monkeypatch):
    monkeypatch.delenv("VLLM_ACCEL_COMPILE_BACKEND", raising=False)


@pytest.fixture()
def fake_habana(monkeypatch):
    """Pretend habana_frameworks.torch is installed (the real one is not)."""
    from vllm_accel import settings

    imported = []
    for name in ("habana_frameworks", "habana_frameworks.torch"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr("importlib.import_module",
                        lambda name: imported.append(name) or sys.modules[name])
    settings._habana_importable.cache_clear()  # looked up once per process
    yield imported
    settings._habana_importable.cache_clear()


def test_cpu_is_chosen_without_habana():
    assert select_backend(load_settings()) == DeviceBackend("cpu", "inductor", True, True)
    per_bucket = load_settings({"accel": {"bucket_graphs": "per_bucket"}})
    assert select_backend(per_bucket) == DeviceBackend("cpu", "inductor", False)
    eager = load_settings({"accel": {"compile_backend": "eager"}})
    assert select_backend(eager) == DeviceBackend("cpu", "eager")
    with pytest.raises(ValueError, match=r"hpu_backend is not available on device 'cpu'"):
        select_backend(load_settings({"accel": {"compile_backend": "hpu_backend"}}))


def test_hpu_is_chosen_when_habana_is_importable(fake_habana):
    assert select_backend(load_settings()) == DeviceBackend("hpu", "hpu_backend")
    assert fake_habana == ["habana_frameworks.torch"]  # registers hpu_backend
    forced_cpu = load_settings({"accel": {"device": "cpu"}})
    assert select_backend(forced_cpu).device == "cpu"


def test_inductor_is_refused_on_hpu_naming_the_setting(fake_habana):
    with pytest.raises(ValueError, match=r"VLLM_ACCEL_COMPILE_BACKEND=inductor .* 'hpu'.*"
                                         r"hpu_backend, eager"):
        select_backend(load_settings({"accel": {"compile_backend": "inductor"}}))
    # A graph per bucket there (the static shapes an HPU graph needs).
    assert not select_backend(load_settings()).shared_bucket_graphs
    with pytest.raises(ValueError, match=r"VLLM_ACCEL_BUCKET_GRAPHS=shared is for devices "
                                         r"'cpu' and 'cuda'.*expected auto or per_bucket"):
        select_backend(load_settings({"accel": {"bucket_graphs": "shared"}}))
    with pytest.raises(ValueError, match=r"accel.bucket_graphs: expected one of auto, "
                                         r"per_bucket, shared"):
        load_settings({"accel": {"bucket_graphs": "dynamic"}})


def test_cuda_is_refused_without_a_gpu_or_without_triton(monkeypatch):
    """Only chosen when asked for; a host that cannot run it fails at start-up
    naming the setting (the GPU itself: tests/test_cuda.py)."""
    import importlib.util

    import torch

    cuda = load_settings({"accel": {"device": "cuda"}})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert select_backend(load_settings()).device == "cpu"  # auto never picks it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"VLLM_ACCEL_DEVICE=cuda, but torch .* sees no CUDA"):
        select_backend(cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    find_spec = importlib.util.find_spec
    for triton in (None, object()):  # not installed, installed
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args, spec=triton:
                            spec if name == "triton" else find_spec(name, *args))
        if triton is None:
            with pytest.raises(ValueError, match=r"VLLM_ACCEL_DEVICE=cuda needs Triton"):
                select_backend(cuda)
        else:
            # One compiled decoder graph for the token buckets above 1, as on
            # the cpu (start-up: benchmarks/README.md), vision towers and
            # encoder-only models a graph per bucket unless shared is asked
            # for; per_bucket where asked for.
            assert select_backend(cuda) == DeviceBackend("cuda", "inductor", True, False)
            shared = load_settings({"accel": {"device": "cuda", "bucket_graphs": "shared"}})
            assert select_backend(shared) == DeviceBackend("cuda", "inductor", True, True)
            per_bucket = load_settings({"accel": {"device": "cuda",
                                                  "bucket_graphs": "per_bucket"}})
            assert select_backend(per_bucket) == DeviceBackend("cuda", "inductor", False)


def test_async_scheduling_stays_on_only_where_it_overlaps():
    from vllm_accel.platform import keeps_async_scheduling

    cpu, cuda = DeviceBackend("cpu", "inductor"), DeviceBackend("cuda", "inductor")
    auto = load_settings()
    assert keeps_async_scheduling(auto, cuda) and not keeps_async_scheduling(auto, cpu)
    assert keeps_async_scheduling(load_settings({"accel": {"async_scheduling": "on"}}), cpu)
    assert not keeps_async_scheduling(load_settings({"accel": {"async_scheduling": "off"}}),
                                      cuda)
    with pytest.raises(ValueError, match=r"--additional-config accel.async_scheduling: "
                                         r"expected one of auto, on, off"):
        load_settings({"accel": {"async_scheduling": "yes"}})


def test_bucket_strategies():
    assert exponential_buckets(1, 128, limit=8) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert exponential_buckets(1, 2048, limit=8) == [1, 4, 16, 64, 256, 1024, 2048]
    assert linear_buckets(64, 64, 300) == [64, 128, 192, 256, 300]
    assert make_buckets("", 1, 100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert make_buckets("64,8, 1", 1, 100) == [1, 8, 64]
    assert make_buckets("exp:min=2,max=32,limit=3", 1, 100) == [2, 8, 32]
    assert make_buckets("lin:step=40", 40, 100) == [40, 80, 100]
    assert find_bucket([1, 8, 64], 9) == 64
    assert find_bucket([1, 8, 64], 65) is None
    # The defaults: token buckets doubling from 8 to 64, then 256, 384, 512 (never above
    # what one step holds), half-octave contexts, thinned vision buckets.
    assert token_buckets("", 8192) == [1, 8, 16, 32, 48, 64, 256, 384, 512]
    assert token_buckets("", 100) == [1, 8, 16, 32, 48, 64, 100]
    assert token_buckets("", 16) == [1, 8, 16]
    assert token_buckets("exp:min=1,limit=4", 8192) == [1, 8, 64, 512]
    assert token_buckets("1,8,64,512", 300) == [1, 8, 64]
    assert half_octave_buckets(1, 64) == [1, 2, 3, 4, 6, 8, 11, 16, 23, 33, 47, 64]
    assert thin_buckets([5, 2, 3, 4], 3) == [2, 4, 5]
    assert thin_buckets([2, 3], 3) == [2, 3] and thin_buckets([2, 3, 9], 1) == [9]


def test_bad_bucket_spec_fails_naming_the_variable(monkeypatch):
    monkeypatch.setenv("VLLM_ACCEL_TOKEN_BUCKETS", "exp:min=1,maxx=4")
    with pytest.raises(ValueError, match=r"VLLM_ACCEL_TOKEN_BUCKETS.*bad field 'maxx=4'"):
        load_settings()
    monkeypatch.setenv("VLLM_ACCEL_TOKEN_BUCKETS", "1,two")
    with pytest.raises(ValueError, match=r"VLLM_ACCEL_TOKEN_BUCKETS.*comma-separated list"):
        load_settings()
