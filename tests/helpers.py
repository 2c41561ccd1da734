"""Helpers for the tests: engines on our platform and HF references."""

from __future__ import annotations

import contextlib
import gc

import torch


@contextlib.contextmanager
def running_llm(model_dir, **kwargs):
    """A vLLM engine on our platform, shut down (and its memory freed) after."""
    from vllm import LLM

    options = dict(dtype="float32", max_model_len=512, seed=0)
    options.update(kwargs)
    llm = LLM(model=str(model_dir), **options)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def model_runner(llm):
    """The AccelModelRunner behind an in-process LLM (for counters)."""
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    return executor.driver_worker.worker.model_runner


_hf_models: dict[tuple[str, torch.dtype], torch.nn.Module] = {}


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int,
              dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """Greedy continuations from HF transformers' own model class, one prompt
    at a time (no padding), stopping at EOS as vLLM does."""
    from transformers import AutoModelForCausalLM

    key = (str(model_dir), dtype)
    if key not in _hf_models:
        _hf_models[key] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model = _hf_models[key]
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False
            )
            outputs.append(out[0, len(ids):].tolist())
    return outputs


def prompt_ids(model_dir, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(t).input_ids for t in texts]


def wait_until_serving(proc, base_url: str, log, timeout: float = 240) -> None:
    """Poll a `vllm serve` subprocess until /health answers; fail with its log."""
    import time

    import pytest
    import requests

    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited early:\n{log.read_text()[-4000:]}")
        try:
            if requests.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        if time.time() > deadline:
            pytest.fail(f"vllm serve not ready in {timeout:.0f} s:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
