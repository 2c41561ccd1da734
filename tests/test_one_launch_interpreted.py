"""A GPU's attention path checked on the cpu: the one-launch layout
(``SequenceTable``), vLLM's Triton kernels (cache store, unified attention,
its split-KV launch) and the layers' own store, against the PyTorch path,
run by Triton's interpreter (numpy, on cpu tensors).

The cases (one_launch_attention.py) run in one process of their own:
vLLM decides at import whether Triton is usable, and with no driver it is
not, unless the visible CUDA devices are set empty (as a distributed worker
can start). float32 and float16 only: the interpreter's bfloat16 attention
gives wrong numbers (test_cuda.py runs bfloat16 on a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from one_launch_attention import cpu_cases

CASES = list(cpu_cases())


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    script = Path(__file__).with_name("one_launch_attention.py")
    run = subprocess.run([sys.executable, str(script), str(tmp_path_factory.mktemp("models"))],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_one_launch_equals_the_pytorch_path(results, case):
    assert results[case] == "ok"
