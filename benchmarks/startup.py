"""Engine start-up, side by side: vllm-accel cold and with its compile cache, vs vLLM's CPU backend.

Each start is a fresh process that imports vLLM and builds `LLM(model)` with the
model's defaults (as a new user would), float32. vllm-accel starts twice per
round: `accel-cold` with an empty compile cache directory, then `accel-warm`
reusing it. Prints, per start, the import time, the `LLM(...)` time and its
breakdown from the engine's log (vllm-accel's `vllm_accel start-up:` line:
model load, KV cache, warmup with its graphs; vLLM's `init engine` figure for
both backends), then medians per backend. Each backend keeps its own vLLM
cache root (in the temp dir, kept between runs), as one installed vLLM would.

    .venv/bin/python benchmarks/startup.py                      # tiny Llama and LlavaNext
    .venv/bin/python benchmarks/startup.py --models llama --rounds 3

With VLLM_ACCEL_BASELINE=DIR (another checkout, e.g. a git worktree of main),
accel-baseline starts that checkout's vllm-accel the same way (cold, warm):
the A/B of a change. With --first-start, each round's cold start also finds
an empty vLLM cache root (a new user's first start: vLLM inspects the
model's class again), which its warm start then reuses.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ACCEL, INIT_LINE, NATIVE, REPO, log, parse_backends

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from vllm import LLM
t1 = time.perf_counter()
options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else dict(dtype="float32", seed=0)
llm = LLM(model=sys.argv[1], **options)
t2 = time.perf_counter()
import torch  # a front-end process that initialized CUDA makes vLLM spawn its engine core
print("STARTUP_RESULT", json.dumps({"import_s": round(t1 - t0, 2), "llm_s": round(t2 - t1, 2),
      "front_end_initialized_cuda": torch.cuda.is_initialized()}), flush=True)
"""
STARTUP_LINE = re.compile(
    r"vllm_accel start-up: model load ([\d.]+) s, KV cache ([\d.]+) s, "
    r"warmup ([\d.]+) s \((\d+) graphs, (\d+) from the compile cache\)")
# Parts of the warmup (cuda: the graphs' capture and vLLM's sampling kernels),
# and inductor's kernel tuning during the start (0 where its cache had it all).
PART_LINES = {
    "buckets_s": re.compile(r"vllm_accel warmup finished in ([\d.]+) s"),
    "cuda_graphs_s": re.compile(r"vllm_accel captured \d+ CUDA graphs .* in ([\d.]+) s"),
    "sampling_kernels_s": re.compile(
        r"vllm_accel sampling kernels compiled for batch sizes \S+ in ([\d.]+) s"),
    "tuning_benchmarks": re.compile(r"vllm_accel start-up: .*, (\d+) kernel tuning benchmarks"),
}
# vLLM's warning when it starts the engine core with spawn rather than fork.
FORCED_SPAWN = "We must use the `spawn` multiprocessing start method"
BACKENDS = ("accel", "native")
BASELINE = os.environ.get("VLLM_ACCEL_BASELINE")
if BASELINE:
    BACKENDS = ("accel", "accel-baseline", "native")
VLLM_CACHE = Path(tempfile.gettempdir()) / "vllm-accel-startup-vllm-cache"


def start_once(python, env, model, log_path, cwd=REPO, options=None):
    """One start in a fresh process: ``LLM(model, **options)`` (default:
    float32, the model's defaults otherwise)."""
    argv = [str(python), "-c", CHILD, model] + ([json.dumps(options)] if options else [])
    with open(log_path, "w") as f:  # vLLM logs to stdout: one file for both
        r = subprocess.run(argv, env=env, cwd=cwd,
                           stdout=f, stderr=subprocess.STDOUT, timeout=1800)
    text = Path(log_path).read_text()
    result = parse_start_log(text)
    if r.returncode != 0 or result is None:
        sys.exit(f"start failed (exit {r.returncode}); log: {log_path}\n{text[-2000:]}")
    return result


def parse_start_log(text: str) -> dict | None:
    """A start's figures from its log (the child's result line, vLLM's and
    the engine's start-up lines); None without a result line."""
    found = re.search(r"^STARTUP_RESULT (.*)$", text, re.M)
    if not found:
        return None
    result = json.loads(found.group(1))
    if m := INIT_LINE.search(text):
        result["init_engine_s"] = float(m.group(1))
    if m := STARTUP_LINE.search(text):
        keys = ("load_s", "kv_s", "warmup_s", "graphs", "cache_hits")
        result.update({k: float(v) for k, v in zip(keys, m.groups())})
    for key, line in PART_LINES.items():
        if m := line.search(text):
            result[key] = float(m.group(1))
    result["forced_spawn"] = FORCED_SPAWN in text
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="llama,llava_next",
                   help="tiny fixtures from vllm_accel.testing.fixtures")
    p.add_argument("--backends", default="accel,native",
                   help="accel and/or native (and accel-baseline, with VLLM_ACCEL_BASELINE)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--log-dir", help="engine logs (default: a temp dir)")
    p.add_argument("--first-start", action="store_true",
                   help="an empty vLLM cache root for each round's cold start")
    args = p.parse_args()
    backends = parse_backends(args.backends, BACKENDS)
    work = Path(tempfile.mkdtemp(prefix="vllm-accel-startup-"))
    log_dir = Path(args.log_dir or work)
    log_dir.mkdir(parents=True, exist_ok=True)

    rows = []
    for model_name in args.models.split(","):
        model = work / model_name
        subprocess.run([str(ACCEL[0]), "-m", "vllm_accel.testing.fixtures", model_name,
                        str(model)], cwd=REPO, check=True, capture_output=True)
        for rnd in range(1, args.rounds + 1):
            order = backends if rnd % 2 else backends[::-1]
            for backend in order:
                # Each vLLM its own cache root: the two versions share the file
                # names of vLLM's model-inspection cache and would redo each
                # other's inspection (~10 s) on every alternation.
                root = (work / f"vllm-{model_name}-{backend}-{rnd}" if args.first_start
                        else VLLM_CACHE / backend)
                vllm_cache = {"VLLM_CACHE_ROOT": str(root)}
                if backend == "native":
                    runs = [("native", {**os.environ, **NATIVE[1], **vllm_cache}, NATIVE[0], REPO)]
                else:
                    cache = work / f"compile-cache-{model_name}-{backend}-{rnd}"
                    env = {**os.environ, **ACCEL[1], **vllm_cache,
                           "VLLM_ACCEL_COMPILE_CACHE_DIR": str(cache)}
                    env.pop("VLLM_ACCEL_KVCACHE_SPACE")  # the default, as a user starts
                    cwd = REPO
                    if backend == "accel-baseline":  # `python -c` finds the cwd's package
                        env["PYTHONPATH"], cwd = BASELINE, BASELINE
                    runs = [(f"{backend}-cold", env, ACCEL[0], cwd),
                            (f"{backend}-warm", env, ACCEL[0], cwd)]
                for name, env, python, cwd in runs:
                    log_path = log_dir / f"{model_name}-{name}-{rnd}.log"
                    res = start_once(python, env, str(model), log_path, cwd)
                    rows.append((model_name, name, res))
                    log(f"{model_name} {name} round {rnd}: {json.dumps(res)}")

    print(f"\n{'model':<11} {'start':<11} {'import s':>8} {'LLM() s':>8} {'init s':>7} "
          f"{'load s':>6} {'KV s':>5} {'warmup s':>8} {'graphs':>6} {'cached':>6}")
    for model_name, name, r in rows:
        print(f"{model_name:<11} {name:<11} {r['import_s']:>8.1f} {r['llm_s']:>8.1f} "
              f"{r.get('init_engine_s', float('nan')):>7.1f} {r.get('load_s', float('nan')):>6.1f} "
              f"{r.get('kv_s', float('nan')):>5.1f} {r.get('warmup_s', float('nan')):>8.1f} "
              f"{int(r.get('graphs', 0)):>6} {int(r.get('cache_hits', 0)):>6}")
    for model_name in args.models.split(","):
        medians = {}
        for name in ("accel-cold", "accel-warm", "accel-baseline-cold", "accel-baseline-warm",
                     "native"):
            values = [r["llm_s"] for m, n, r in rows if m == model_name and n == name]
            if values:
                medians[name] = statistics.median(values)
        print(f"startup {model_name}: " + " ".join(
            f"{k}={v:.1f}s" for k, v in medians.items()) + " (median LLM() seconds)")


if __name__ == "__main__":
    main()
