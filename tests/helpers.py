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


@contextlib.contextmanager
def tensor_parallel_workers():
    """Around an engine whose workers are processes of vLLM's multiprocessing
    executor: workers started with spawn (as the platform would choose), and
    this process left as it was. vLLM drops the engine's process to one torch
    thread and sets OMP_NUM_THREADS in its environment, which every later
    subprocess would inherit (a compile cache filled by one thread misses in a
    process with two: inductor writes the thread count into its kernels)."""
    import os

    import pytest
    from vllm.utils.torch_utils import OMP_NUM_THREADS_SET_BY_VLLM

    threads = torch.get_num_threads()
    names = ("OMP_NUM_THREADS", OMP_NUM_THREADS_SET_BY_VLLM)
    saved = {name: os.environ.get(name) for name in names}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def model_runner(llm):
    """The AccelModelRunner behind an in-process LLM (for counters)."""
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    return executor.driver_worker.worker.model_runner


_hf_models: dict[tuple[str, torch.dtype], torch.nn.Module] = {}


def hf_model(model_dir, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """HF transformers' own causal LM class for ``model_dir``, loaded once per
    (model, dtype) in this process."""
    from transformers import AutoModelForCausalLM

    key = (str(model_dir), dtype)
    if key not in _hf_models:
        _hf_models[key] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    return _hf_models[key]


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int,
              dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """Greedy continuations from HF transformers' own model class, one prompt
    at a time (no padding), stopping at EOS as vLLM does."""
    model = hf_model(model_dir, dtype)
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


# ---- vision-language models ------------------------------------------------

def noise_image(width, height, seed=0):
    """A deterministic RGB noise image (PIL)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed + width * 1000 + height)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def chat_prompt(processor, num_images: int, question: str) -> str:
    """One user message: num_images image parts, then the question."""
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": question}]
    return processor.apply_chat_template([{"role": "user", "content": content}],
                                         add_generation_prompt=True)


def hf_vision_greedy(hf, prompt: str, images: list, max_tokens: int) -> list[int]:
    """Greedy continuation from HF's own model class; hf = (processor, model)."""
    processor, model = hf
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return out[0, inputs.input_ids.shape[1]:].tolist()


def vision_greedy(llm, cases, max_tokens: int) -> list[list[int]]:
    """Greedy token ids for (prompt, images) cases, submitted as one batch."""
    from vllm import SamplingParams

    requests = [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else {"prompt": p}
                for p, imgs in cases]
    outs = llm.generate(requests, SamplingParams(temperature=0, max_tokens=max_tokens),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def kill_a_worker_and_wait_for_exit(proc, log, num_workers: int) -> str:
    """Kill one tensor-parallel worker of a `vllm serve` process; the server
    must exit within 60 s. Returns its log text."""
    import subprocess

    import psutil
    import pytest

    workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
               if "Worker_TP" in " ".join(p.cmdline()) or "Worker_TP" in p.name()]
    assert len(workers) == num_workers, [p.cmdline() for p in workers]
    workers[1].kill()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"server still up 60 s after a worker died:\n{log.read_text()[-3000:]}")
    return log.read_text()


def in_forward(attention=None, **kernels):
    """Within: a forward's context with the step's ``attention`` layout (if
    any: one, or one per KV cache group) and these CPU kernels (linear=,
    span=, decode=; None: torch's path)."""
    from vllm_accel.forward_context import ForwardContext, set_forward_context
    from vllm_accel.kernels import CpuKernels
    from vllm_accel.model.paged_attention import PagedAttentionMetadata

    if isinstance(attention, PagedAttentionMetadata):
        attention = (attention,)
    return set_forward_context(ForwardContext(attention=attention, kernels=CpuKernels(**kernels)))
