"""A small soak of `vllm serve` on the tiny LlavaNext: benchmarks/serve_load.py
with 60 mixed requests at concurrency 8 (text and image chats, streaming,
n>1, logprobs, prompt logprobs, disconnects mid-stream, an abort storm and
deliberately bad requests); afterwards the server must be clean and alive."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # engines and servers: the full suite only

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "serve_load.py"


def load_script():
    spec = importlib.util.spec_from_file_location("serve_load", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_load"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    serve_load = load_script()
    args = serve_load.parse_args(["--requests", "60", "--concurrency", "8",
                                  "--load-timeout", "240", "--request-timeout", "120",
                                  "--workdir", str(tmp_path_factory.mktemp("serve-load"))])
    summary = serve_load.run(args)
    print(serve_load.final_line(summary))
    return serve_load, summary


def test_every_request_accounted_for(soak):
    _, s = soak
    assert s["failed"] == 0, s["failures"]
    assert s["requests"] == 60
    assert s["done"] + s["bad_4xx"] + s["disconnected"] + s["aborted"] == s["requests"]
    assert s["disconnected"] >= 1 and s["aborted"] >= 4
    assert s["done"] >= 40 and s["p50_ms"] > 0


def test_deliberately_bad_requests_each_get_a_4xx(soak):
    _, s = soak
    assert sorted(kind for kind, _ in s["bad_codes"]) == [
        "corrupt_image", "too_long_prompt", "too_many_images"]
    assert all(code == 400 for _, code in s["bad_codes"]), s["bad_codes"]


def test_server_clean_and_alive_afterwards(soak):
    serve_load, s = soak
    assert s["kv_usage_after"] == 0.0
    state = s["runner_state"]
    assert state["requests"] == state["batch_requests"] == 0, state
    assert state["prompt_logprobs_pending"] == state["rope_positions"] == 0, state
    # vLLM keeps encoder outputs of finished requests until it needs the space
    # (EncoderCacheManager.freeable), and the runner mirrors it: bounded, not 0.
    assert state["encoder_cache_rows"] <= s["encoder_cache_bound"], state
    assert s["encoder_cache_after_reset"] == 0
    assert s["runtime_compiles"] == 0 and state["runtime_compiles"] == 0
    assert s["warmup_line"] is not None
    assert s["alive"]
    assert serve_load.invariants(s) == []
