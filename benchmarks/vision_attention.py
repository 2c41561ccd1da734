#!/usr/bin/env python3
"""Vision-tower attention per call: our CPU kernel vs torch's SDPA (flash), bfloat16.

Shapes of the hub's towers: SigLIP so400m on 2 tiles of 384 px (729 tokens,
16 heads of 72), Molmo's ViT on 13 crops (577 tokens, 16 heads of 64) and a
Qwen2.5-VL full-attention block over one 448x448 image (1,024 patches, 16
heads of 80). Rounds alternate the two paths; each round times a path for
--seconds; figures are the median ms per call with min-max, GFLOP/s (4 N^2 d
per head and image), the ratio of medians, and each path's mean and max error
against float64 SDPA on the same (bfloat16) inputs.

    python benchmarks/vision_attention.py [--rounds 5] [--seconds 2]

Last line per shape: "vision attention <shape>: kernel=<ms> ms sdpa=<ms> ms speedup=<x>".
"""
import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from common import time_per_call

from vllm_accel.model import vision_attention

SHAPES = {"siglip-2-tiles": (2, 729, 16, 72), "molmo-13-crops": (13, 577, 16, 64),
          "qwen2_5_vl-448px": (1, 1024, 16, 80)}  # images, tokens, heads, head size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    assert vision_attention.enable(Path(tempfile.mkdtemp())) is not None, \
        "the kernel is not available here (see the log line above)"
    for name, (images, tokens, heads, dim) in SHAPES.items():
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(images, tokens, heads, dim, generator=g).bfloat16()
                   for _ in range(3))
        scale = dim ** -0.5
        paths = {"kernel": lambda: vision_attention.attend(q, k, v, scale),
                 "sdpa": lambda: vision_attention.reference(q, k, v, scale)}
        exact = vision_attention.reference(q.double(), k.double(), v.double(), scale)
        errors = {path: (fn().double() - exact).abs() for path, fn in paths.items()}
        times: dict[str, list[float]] = {path: [] for path in paths}
        for round_ in range(args.rounds):
            for path in (paths if round_ % 2 == 0 else reversed(paths)):
                times[path].append(time_per_call(paths[path], args.seconds))
        flops = 4 * images * heads * tokens ** 2 * dim
        medians = {path: statistics.median(t) for path, t in times.items()}
        for path, t in times.items():
            print(f"{name:17} {path:6} {medians[path]:8.2f} ms per call (min-max "
                  f"{min(t):.2f}-{max(t):.2f}, {args.rounds} rounds), "
                  f"{flops / medians[path] / 1e6:5.0f} GFLOP/s, error mean "
                  f"{errors[path].mean():.2e} max {errors[path].max():.2e}")
        print(f"vision attention {name} ({images} x {tokens} tokens, {heads} heads of {dim}, "
              f"bfloat16): kernel={medians['kernel']:.2f} ms sdpa={medians['sdpa']:.2f} ms "
              f"speedup={medians['sdpa'] / medians['kernel']:.2f}")


if __name__ == "__main__":
    main()
