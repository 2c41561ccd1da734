"""`vllm serve` on our platform, as a user runs it: a subprocess on 127.0.0.1
answering the OpenAI API through the `openai` client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import requests

from helpers import hf_greedy, prompt_ids, wait_until_serving

pytestmark = pytest.mark.slow  # engines and servers: the full suite only

VLLM = str(Path(sys.executable).with_name("vllm"))
MAX_MODEL_LEN = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(**extra) -> dict:
    env = dict(os.environ, VLLM_ACCEL_KVCACHE_SPACE="0.25", **extra)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # serve as users do
    return env


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [VLLM, "serve", str(tiny_models["llama"]), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)]
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, env=server_env(VLLM_PLUGINS="accel"),
                                stdout=log_file, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, base, log)
        yield base, str(tiny_models["llama"]), log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_log_names_our_platform(server):
    _, _, log = server
    assert "vllm-accel platform active: device backend 'cpu'" in log.read_text()


def test_completion_matches_hf(server, client):
    _, model, _ = server
    prompt = "The quick brown fox"
    out = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    expected = hf_greedy(model, prompt_ids(model, [prompt]), 12)[0]
    from transformers import AutoTokenizer

    assert out.choices[0].text == AutoTokenizer.from_pretrained(model).decode(expected)
    assert out.usage.completion_tokens == 12


def test_chat_plain_and_streamed_agree(server, client):
    _, model, _ = server
    messages = [{"role": "user", "content": "Tell me a story."}]
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                           temperature=0)
    text = plain.choices[0].message.content
    assert text and plain.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                            temperature=0, stream=True)
    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(chunks) > 1
    assert "".join(chunks) == text


def test_metrics_endpoint(server, client):
    base, model, _ = server
    client.completions.create(model=model, prompt="hi", max_tokens=2)
    metrics = requests.get(f"{base}/metrics", timeout=10).text
    assert "vllm:generation_tokens_total" in metrics
    assert "vllm:prefix_cache_queries_total" in metrics


def test_too_long_prompt_is_a_400_and_server_keeps_serving(server, client):
    _, model, _ = server
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=model, prompt=[7] * (MAX_MODEL_LEN + 10), max_tokens=4)
    assert error.value.status_code == 400
    assert str(MAX_MODEL_LEN) in str(error.value)
    out = client.completions.create(model=model, prompt="still there?", max_tokens=4)
    assert out.usage.completion_tokens == 4


def test_prompt_logprobs_over_the_api(server, client):
    """What lm-evaluation-harness asks for log-likelihood scoring: one entry
    per prompt token, None for the first (nothing predicts it)."""
    _, model, _ = server
    out = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=1,
                                    extra_body={"prompt_logprobs": 2})
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == out.usage.prompt_tokens and entries[0] is None
    assert all(2 <= len(entry) <= 3 for entry in entries[1:])


def test_unrelated_plugin_list_leaves_our_platform_off(tiny_models):
    result = subprocess.run(
        [VLLM, "serve", str(tiny_models["llama"]), "--port", str(free_port())],
        env=server_env(VLLM_PLUGINS="some_other_plugin"),
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode != 0
    assert "Failed to infer device type" in result.stdout + result.stderr
    assert "vllm-accel platform active" not in result.stdout + result.stderr
