"""A GPU's attention path against the PyTorch path, on either device.

On cuda a forward's layout is one ``SequenceTable`` and one launch of vLLM's
Triton kernel attends it (the layers store the keys/values themselves; few
decodes take the split-KV launch). Each case here lays the same work out both
ways and compares. test_cuda.py runs them on a GPU; test_one_launch_interpreted.py
runs them on the cpu under Triton's interpreter (``python one_launch_attention.py
DIRECTORY [CASE ...]`` in a process of its own: vLLM decides at import whether
Triton is usable).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np
import torch

from helpers import in_forward
from vllm_accel.model.paged_attention import TableShape, paged_attention, register_paged_attention
from vllm_accel.patches import exact_float32_dots
from vllm_accel.worker.step_layout import pack_step

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _both_layouts(step, block_size, plan, window=0, max_sequences=4, width=8):
    """A step's forwards laid out twice: for the PyTorch path, then each as
    one ``SequenceTable``."""
    return [pack_step(*step, block_size, plan, lambda blocks: width, table_shape=shape,
                      window=window).forwards
            for shape in (None, TableShape(max_sequences=max_sequences, width=width))]


def _watched_scratch(heads: int, kv_heads: int, dim: int, device: str):
    """The worker's split-KV scratch, its maxima NaN: a launch that splits
    writes them (vLLM's kernel picks the split from the shapes)."""
    from vllm_accel.compat import SplitKvScratch

    scratch = SplitKvScratch.allocate(heads, kv_heads, dim, device)
    scratch.max.fill_(float("nan"))
    return scratch


def one_launch_equals_pytorch_path(device: str, dtype: torch.dtype, sinks: bool,
                                   window: int) -> None:
    """One step (two decodes, a chunk with earlier context, a new prompt cut
    by the forward's end) laid out both ways: the same attention output;
    also with attention sinks (Triton's sinks= against the explicit softmax)
    and a window that cuts the decodes' and the chunk's context."""
    exact_float32_dots()
    register_paged_attention()
    block, heads, kv_heads, dim, blocks = 16, 8, 2, 64, 64
    g = torch.Generator().manual_seed(0)
    step = (np.zeros((4, 256), dtype=np.int64),  # token ids (unread here)
            np.arange(1, 1 + 4 * 8).reshape(4, 8),  # 8 blocks a request
            np.array([1, 40, 1, 30]), np.array([70, 20, 5, 0]))  # tokens, first positions
    # 72 tokens: the first forward takes 64 (the new prompt's first 22).
    layouts = [forwards[0].attn_metadata.to(device)
               for forwards in _both_layouts(step, block, lambda n: [64, 64], window)]
    shape = (1, 64, heads, dim)
    query, key, value = (torch.randn(*s, generator=g).to(device, dtype)
                         for s in (shape, shape[:2] + (kv_heads, dim), shape[:2] + (kv_heads, dim)))
    head_sinks = (torch.randn(heads, generator=g) + 1).to(device, dtype) if sinks else None
    outputs = []
    for metadata in layouts:
        same = torch.Generator().manual_seed(1)  # the same caches for both
        caches = [torch.randn(blocks, block, kv_heads, dim, generator=same).to(device, dtype)
                  for _ in range(2)]
        with in_forward(metadata):
            out = paged_attention(query, key, value, *caches, dim ** -0.5, head_sinks)
        outputs.append(out[0].float())
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(outputs[1], outputs[0], atol=tolerance, rtol=tolerance)


def split_kv_equals_one_pass(device: str, dtype: torch.dtype) -> None:
    """Decodes alone (contexts of 1 to 100 tokens) through the split-KV launch
    with the worker's scratch: the one-pass launch's output, and the split
    launch really taken."""
    exact_float32_dots()
    register_paged_attention()
    block, heads, kv_heads, dim, blocks = 16, 8, 2, 64, 32
    g = torch.Generator().manual_seed(2)
    step = (np.zeros((3, 128), dtype=np.int64), np.arange(1, 1 + 3 * 7).reshape(3, 7),
            np.array([1, 1, 1]), np.array([99, 0, 40]))
    (forward,) = _both_layouts(step, block, lambda n: [4], max_sequences=4, width=7)[1]
    one_pass = forward.attn_metadata.to(device)
    scratch = _watched_scratch(heads, kv_heads, dim, device)
    split = dataclasses.replace(one_pass, split_kv=scratch)
    query = torch.randn(1, 4, heads, dim, generator=g).to(device, dtype)
    caches = [torch.randn(blocks, block, kv_heads, dim, generator=g).to(device, dtype)
              for _ in range(2)]
    outputs = []
    for metadata in (one_pass, split):
        with in_forward(metadata):
            # The caches already hold the keys (as where the layers store them).
            out = paged_attention(query, query[:, :, :kv_heads], query[:, :, :kv_heads],
                                  *caches, dim ** -0.5, None, None, True)
        outputs.append(out[0, :3].float())
    assert not scratch.max[:3].isnan().all(), "the split launch did not run"
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(outputs[1], outputs[0], atol=tolerance, rtol=tolerance)


def model_equals_pytorch_path(device: str, arch: str, directory: str) -> None:
    """A tiny model of ``arch`` (float32) runs two prompts, then two decode
    steps (the first crossing into a new block; those of one launch through
    the split-KV launch), its layers storing the keys/values themselves where
    the layout is one launch: the same hidden states and caches as the
    PyTorch path, where the op stores them."""
    from transformers import AutoConfig

    from vllm_accel.model.fms_causal_lm import FmsCausalLM, load_fms_model
    from vllm_accel.testing.fixtures import make_tiny_model

    exact_float32_dots()
    register_paged_attention()
    path = make_tiny_model(arch, os.path.join(directory, arch))
    lm = FmsCausalLM(load_fms_model(str(path), AutoConfig.from_pretrained(path),
                                    torch.float32, device))
    block, width = 8, 4
    g = torch.Generator().manual_seed(3)
    token_ids = torch.randint(2, 50, (2, 16), generator=g).numpy()
    table = np.array([[1, 3, 5, 0], [2, 4, 6, 0]])
    steps = [  # (tokens each request runs, its first position, the forward's bucket)
        (np.array([8, 5]), np.array([0, 0]), 16),
        (np.array([1, 1]), np.array([8, 5]), 2),
        (np.array([1, 1]), np.array([9, 6]), 2),
    ]
    scratch = _watched_scratch(lm.num_heads, lm.num_kv_heads, lm.head_dim, device)
    hidden, caches = [], []
    for table_shape in (None, TableShape(max_sequences=2, width=width)):
        kv = [tuple(torch.zeros(8, block, lm.num_kv_heads, lm.head_dim, device=device)
                    for _ in range(2)) for _ in range(lm.num_layers)]
        states = []
        for counts, starts, bucket in steps:
            (forward,) = pack_step(token_ids, table, counts, starts, block, lambda n: [bucket],
                                   lambda blocks: width, table_shape=table_shape).forwards
            layout, tokens = forward.attn_metadata, forward.end - forward.begin
            if table_shape is not None and layout.num_decodes == tokens:
                layout = dataclasses.replace(layout, split_kv=scratch)
            with torch.no_grad(), in_forward(layout.to(device)):
                out = lm(forward.input_ids.to(device), forward.positions.to(device), kv)
            states.append(out[0, :tokens].float().cpu())
        hidden.append(states)
        caches.append([c[1:].cpu() for layer in kv for c in layer])  # block 0: padding's
    assert not scratch.max[:2].isnan().all(), "the decodes did not take the split launch"
    # Attention's rounding differs by path, and later layers carry it on.
    for got, expected in zip(hidden[1] + caches[1], hidden[0] + caches[0]):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def cpu_cases() -> dict:
    """name: (case, its arguments after the device); a model's directory is
    the last argument, filled in by ``run_on_cpu_interpreted``."""
    from vllm_accel.architectures import by_model_type
    from vllm_accel.testing.fixtures import SUPPORTED_ARCHS

    cases = {
        "plain": (one_launch_equals_pytorch_path, (torch.float32, False, 0)),
        "sinks": (one_launch_equals_pytorch_path, (torch.float32, True, 0)),
        "sinks+window": (one_launch_equals_pytorch_path, (torch.float32, True, 24)),
        "plain_float16": (one_launch_equals_pytorch_path, (torch.float16, False, 0)),
        "split_kv": (split_kv_equals_one_pass, (torch.float32,)),
        "split_kv_float16": (split_kv_equals_one_pass, (torch.float16,)),
    }
    # Recurrent layers keep their own layout (not the attention's).
    for arch in SUPPORTED_ARCHS:
        if by_model_type(arch).recurrent_state is None:
            cases[f"model_{arch}"] = (model_equals_pytorch_path, (arch,))
    return cases


def run_on_cpu_interpreted(names, directory: str) -> dict[str, str]:
    """Run the named cases on the cpu (this process must have started under
    Triton's interpreter; models written under ``directory``): each one's
    "ok" or its error."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    # vLLM's cache store kernel picks its launch by the GPU's generation.
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    cases, results = cpu_cases(), {}
    for name in names or cases:
        case, args = cases[name]
        if case is model_equals_pytorch_path:
            args = (*args, directory)
        try:
            case("cpu", *args)
            results[name] = "ok"
        except Exception as error:  # reported by the test that asked for it
            results[name] = f"{type(error).__name__}: {error}"
    return results


if __name__ == "__main__":  # DIRECTORY [CASE ...]: a JSON line of results
    print(json.dumps(run_on_cpu_interpreted(sys.argv[2:], sys.argv[1])))
