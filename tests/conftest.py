"""Shared fixtures: tiny offline checkpoints, vLLM engines on our platform, and
HF transformers as the reference we did not write."""

from __future__ import annotations

import os
from pathlib import Path

# Offline, small, and in-process: the engine core runs in the test process so
# tests can read the runner's counters; the KV budget fits tiny models.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("VLLM_ACCEL_KVCACHE_SPACE", "0.25")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_PLUGINS", "accel")
# Under pytest-xdist (the README's -n 2) each worker takes one core's worth of
# threads, and so do the servers and workers it starts: two workers share two
# cores (the kernel tests take every core back: ``every_core``).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tests compare against eager unless they ask for a compile backend themselves.
os.environ.setdefault("VLLM_ACCEL_COMPILE_BACKEND", "eager")

import pytest  # noqa: E402

from vllm_accel.testing.fixtures import SUPPORTED_ARCHS, make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model(arch, root / arch) for arch in SUPPORTED_ARCHS}


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory) -> Path:
    """One build of each CPU kernel for the tests that only run them (a build
    takes seconds); tests of building itself take a fresh directory."""
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture
def every_core():
    """Torch threads for every core this process may use, for the test: our
    kernels split their work across torch's thread count, which must be more
    than one for those splits to be tested (an xdist worker runs one)."""
    import torch
    from vllm.utils.torch_utils import available_cpu_count

    threads = torch.get_num_threads()
    torch.set_num_threads(available_cpu_count())
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def with_bfloat16(monkeypatch):
    """``with_bfloat16(kernel)``: our linear or span-attention kernel runs
    bfloat16 for this test wherever its build does, AMX or not. The engine
    leaves bfloat16 to torch on a CPU with AMX (kernels/build.py), but the
    kernel's bfloat16 still serves every other AVX-512 BF16 CPU, so it is
    tested there too. Skips where the build runs no bfloat16."""
    import torch

    def on(kernel):
        if kernel is None or torch.bfloat16 not in kernel.runs:
            pytest.skip("the kernel's bfloat16 needs AVX-512 BF16")
        monkeypatch.setattr(kernel, "dtypes", kernel.dtypes | {torch.bfloat16})
        return kernel
    return on


@pytest.fixture()
def client(server):
    """An OpenAI client of the module's ``server`` fixture (base URL, model, log)."""
    import openai

    base, _, _ = server
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
