#!/usr/bin/env python3
"""A mixture-of-experts layer per call: FMS's own ``MOEFeedForward`` (its CPU
path: the ``moe::moe_mm`` op's loop over experts), a plain per-expert loop (HF
transformers' way: each expert's tokens found with ``torch.where``), and our
``Experts`` (vllm_accel/model/experts.py) in each form: experts grouped in one
op by our kernel, by oneDNN or by torch's matmul, and dense (every expert over
every token). Router included, no tensor parallelism.

A Mixtral-shaped layer, ~28M parameters (hidden 768, 8 experts, top 2, expert
intermediate 1536), at 1, 16 and 256 tokens (a decode, a small batch, a
prompt chunk). Rounds alternate the order of the paths; each round times a path
for --seconds; figures are the median ms per call with min-max. Our kernel's
form runs every dtype its build runs here (an engine leaves float32 to oneDNN
on a CPU with AVX2 alone); "engine" names the form an engine would pick.

    python benchmarks/experts.py [--rounds 5] [--seconds 1] [--dtype float32] [--tokens 1,16,256]

Last line per token count: "experts tokens=<n> <dtype>: fms=<ms> loop=<ms> kernel=<ms> ... ms".
"""
import argparse
import statistics
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from common import time_per_call
from fms.modules.feedforward import MOEFeedForward

from vllm_accel import kernels
from vllm_accel.forward_context import ForwardContext, set_forward_context
from vllm_accel.model.experts import DENSE, KERNEL, ONEDNN, TORCH, Experts, choose_form

HIDDEN, EXPERTS, TOP_K, INTERMEDIATE = 768, 8, 2, 1536


def per_expert_loop(moe: MOEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """HF transformers' MixtralExperts loop, over FMS's weights."""
    rows = x.reshape(-1, HIDDEN)
    probs = F.softmax(moe.gate(rows).float(), dim=-1)
    weights, ids = probs.topk(TOP_K, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    w13, w2 = moe.cond_ffn.w13, moe.cond_ffn.w2
    out = torch.zeros_like(rows)
    for expert in range(EXPERTS):
        token, k = torch.where(ids == expert)
        if token.numel():
            gate, up = F.linear(rows[token], w13[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[expert]) * weights[token, k, None]
            out.index_add_(0, token, y.to(out.dtype))
    return out.view(x.shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tokens", default="1,16,256")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    linear = kernels.load(Path(tempfile.mkdtemp())).linear
    engine_form = choose_form(torch.empty(1, 2, HIDDEN, dtype=dtype),
                              torch.empty(1, HIDDEN, 2, dtype=dtype), linear)
    if linear is not None:
        linear.dtypes = set(linear.runs)
    torch.manual_seed(0)
    moe = MOEFeedForward(EXPERTS, TOP_K, HIDDEN, INTERMEDIATE)
    moe.reset_parameters()
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.1)
    moe = moe.to(dtype).eval()
    forms = [KERNEL] if linear is not None and dtype in linear.runs else []
    forms += [ONEDNN] if choose_form(moe.cond_ffn.w13, moe.cond_ffn.w2, None) == ONEDNN else []
    forms += [TORCH, DENSE]
    layers = {form: Experts(moe, form, linear) for form in forms}
    print(f"{torch.get_num_threads()} threads, {args.dtype}, "
          f"{sum(p.numel() for p in moe.parameters()) / 1e6:.1f}M parameters; "
          f"an engine's form: {engine_form}")

    with torch.inference_mode(), set_forward_context(
            ForwardContext(kernels=kernels.CpuKernels(linear=linear))):
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(1, tokens, HIDDEN).to(dtype)
            paths = {"fms": lambda: moe(x), "loop": lambda: per_expert_loop(moe, x)}
            paths.update({form: (lambda layer=layer: layer(x)) for form, layer in layers.items()})
            expected = paths["loop"]().float()
            for name, path in paths.items():
                error = (path().float() - expected).abs().max().item() / expected.abs().max().item()
                assert error < (1e-4 if dtype == torch.float32 else 3e-2), (name, error)
            times: dict[str, list[float]] = {name: [] for name in paths}
            for round_ in range(args.rounds):
                order = list(paths) if round_ % 2 == 0 else list(reversed(paths))
                for name in order:
                    times[name].append(time_per_call(paths[name], args.seconds, warmup=2))
            medians = {name: statistics.median(t) for name, t in times.items()}
            for name, t in times.items():
                print(f"{tokens:4} tokens {name:7} {medians[name]:8.2f} ms per call "
                      f"(min-max {min(t):.2f}-{max(t):.2f}, {args.rounds} rounds)")
            print(f"experts tokens={tokens} {args.dtype}: "
                  + " ".join(f"{name}={median:.2f}" for name, median in medians.items()) + " ms")


if __name__ == "__main__":
    main()
