#!/usr/bin/env python3
"""Decode attention per call: our CPU kernel vs the PyTorch path (gather + SDPA).

One call attends one decode token per request over its paged context, as in
an engine step: random block tables, and each call reads the next of
--layers caches, as a forward's layers do (together larger than the CPU's
caches, so keys and values come from memory). Shapes of the benchmark
models: the tiny Llama (4 heads, 2 KV heads, dim 64) at 64 requests and the
~90M Llama (16 heads, 4 KV heads) at 32, with contexts of 96-192 tokens (the
128 in / 64 out workload). Rounds alternate the two paths; each round times a
path for --seconds; figures are the median ms per call with min-max, and the
ratio of medians.

    python benchmarks/decode_attention.py [--rounds 5] [--seconds 2] [--dtype float32] [--layers 8]

Last line per shape: "decode attention <shape>: kernel=<ms> ms pytorch=<ms> ms speedup=<x>".

Large buffers are kept in the heap (glibc mallopt), as they are in a running
engine (8-16 minor page faults per batch of the ~90M benchmark): in a fresh
process glibc may instead map and unmap the PyTorch path's ~6 MB gathered copies
on every call, which made that path 2-3x slower in some processes and not others.
"""
import argparse
import ctypes
import itertools
import statistics
import tempfile
from pathlib import Path

import torch
from common import time_per_call

from vllm_accel.kernels import decode_attention as decode_kernel
from vllm_accel.model.paged_attention import PagedAttentionMetadata, _attend_decodes

BLOCK_SIZE, NUM_BLOCKS, CONTEXT = 32, 2000, (96, 192)
SHAPES = {"tiny": (64, 4, 2, 64), "medium": (32, 16, 4, 64)}  # rows, heads, kv heads, dim


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--layers", type=int, default=8,
                        help="KV caches read in turn (1: the same cache every call, from the CPU's caches)")
    args = parser.parse_args()
    libc = ctypes.CDLL(None)
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep freed memory
    libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: buffers up to 32 MiB from the heap
    dtype = getattr(torch, args.dtype)
    kernel = decode_kernel.load(Path(tempfile.mkdtemp()))
    assert kernel is not None, "the kernel did not build (see the warning above)"

    for name, (rows, heads, kv_heads, dim) in SHAPES.items():
        g = torch.Generator().manual_seed(0)
        layers = [[torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, dim, generator=g).to(dtype)
                   for _ in range(2)] for _ in range(args.layers)]
        caches = itertools.cycle(layers)
        lens = torch.randint(*CONTEXT, (rows,), generator=g)
        width = -(-CONTEXT[1] // BLOCK_SIZE)
        md = PagedAttentionMetadata(
            slot_mapping=torch.zeros(rows, dtype=torch.long), num_decodes=rows,
            decode_block_table=torch.randint(1, NUM_BLOCKS, (rows, width), generator=g),
            decode_context_lens=lens)
        query = torch.randn(rows, heads, dim, generator=g).to(dtype)
        paths = {
            "kernel": lambda: kernel(query, *next(caches), md.decode_block_table, lens, 0.125),
            "pytorch": lambda: _attend_decodes(query, *next(caches), md, 0.125,  # no kernel in use
                                               torch.empty_like(query)),
        }
        pytorch_out = torch.empty_like(query)
        _attend_decodes(query, *layers[0], md, 0.125, pytorch_out)
        torch.testing.assert_close(kernel(query, *layers[0], md.decode_block_table, lens, 0.125),
                                   pytorch_out, rtol=2e-2, atol=2e-2)
        times: dict[str, list[float]] = {path: [] for path in paths}
        for round_ in range(args.rounds):
            order = list(paths) if round_ % 2 == 0 else list(reversed(paths))
            for path in order:
                times[path].append(time_per_call(paths[path], args.seconds))
        medians = {path: statistics.median(t) for path, t in times.items()}
        for path, t in times.items():
            print(f"{name:7} {path:8} {medians[path]:7.3f} ms per call "
                  f"(min-max {min(t):.3f}-{max(t):.3f}, {args.rounds} rounds)")
        print(f"decode attention {name} ({rows} decodes, {heads}/{kv_heads} heads, {args.dtype}, "
              f"{args.layers} layers): "
              f"kernel={medians['kernel']:.3f} ms pytorch={medians['pytorch']:.3f} ms "
              f"speedup={medians['pytorch'] / medians['kernel']:.2f}")


if __name__ == "__main__":
    main()
