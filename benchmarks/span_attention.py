#!/usr/bin/env python3
"""Span attention per call: our CPU kernel vs torch's SDPA (flash), bfloat16 or float32.

Shapes of the hub's towers: SigLIP so400m on 2 tiles of 384 px (729 tokens,
16 heads of 72), Molmo's ViT on 13 crops (577 tokens, 16 heads of 64) and a
Qwen2.5-VL full-attention block over one 448x448 image (1,024 patches, 16
heads of 80); and prompts' causal attention with grouped query heads: the
~128M Llama's 128-token prompt (18 heads over 6 KV heads, 64 each) and a
LlavaNext prompt of ~2,000 tokens (the tiny LM's 8 over 4). Rounds alternate
the two paths; each round times a path for --seconds; figures are the median
ms per call with min-max, GFLOP/s (4 N^2 d per head and image, half of it
causal), the ratio of medians, and each path's mean and max error against
float64 SDPA on the same inputs.

    python benchmarks/span_attention.py [--rounds 5] [--seconds 2] [--dtype float32]

Last line per shape: "span attention <shape>: kernel=<ms> ms sdpa=<ms> ms speedup=<x>".
"""
import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from common import time_per_call

from vllm_accel.forward_context import ForwardContext, set_forward_context
from vllm_accel.kernels import CpuKernels, span_attention

# images, tokens, heads, KV heads, head size, causal
SHAPES = {"siglip-2-tiles": (2, 729, 16, 16, 72, False),
          "molmo-13-crops": (13, 577, 16, 16, 64, False),
          "qwen2_5_vl-448px": (1, 1024, 16, 16, 80, False),
          "prompt-128m-128": (1, 128, 18, 6, 64, True),
          "prompt-llava-2000": (1, 2000, 8, 4, 64, True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    kernel = span_attention.load(Path(tempfile.mkdtemp()))
    assert kernel is not None, "the kernel is not available here (see the log line above)"
    forward = set_forward_context(ForwardContext(kernels=CpuKernels(span=kernel)))
    forward.__enter__()  # kept referenced: the context stays set for the whole run
    for name, (images, tokens, heads, kv_heads, dim, causal) in SHAPES.items():
        g = torch.Generator().manual_seed(0)
        q = torch.randn(images, tokens, heads, dim, generator=g).to(dtype)
        k, v = (torch.randn(images, tokens, kv_heads, dim, generator=g).to(dtype)
                for _ in range(2))
        scale = dim ** -0.5
        paths = {"kernel": lambda: span_attention.attend(q, k, v, scale, causal=causal),
                 "sdpa": lambda: span_attention.reference(q, k, v, scale, causal=causal)}
        exact = span_attention.reference(q.double(), k.double(), v.double(), scale,
                                         causal=causal)
        errors = {path: (fn().double() - exact).abs() for path, fn in paths.items()}
        times: dict[str, list[float]] = {path: [] for path in paths}
        for round_ in range(args.rounds):
            for path in (paths if round_ % 2 == 0 else reversed(paths)):
                times[path].append(time_per_call(paths[path], args.seconds))
        flops = 4 * images * heads * tokens ** 2 * dim / (2 if causal else 1)
        medians = {path: statistics.median(t) for path, t in times.items()}
        for path, t in times.items():
            print(f"{name:17} {path:6} {medians[path]:8.2f} ms per call (min-max "
                  f"{min(t):.2f}-{max(t):.2f}, {args.rounds} rounds), "
                  f"{flops / medians[path] / 1e6:5.0f} GFLOP/s, error mean "
                  f"{errors[path].mean():.2e} max {errors[path].max():.2e}")
        print(f"span attention {name} ({images} x {tokens} tokens, {heads} heads over "
              f"{kv_heads} of {dim}{', causal' if causal else ''}, {args.dtype}): "
              f"kernel={medians['kernel']:.2f} ms sdpa={medians['sdpa']:.2f} ms "
              f"speedup={medians['sdpa'] / medians['kernel']:.2f}")


if __name__ == "__main__":
    main()
