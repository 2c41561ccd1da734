"""An A/B of two vllm-accel checkouts on one GPU (run on the accelerator host):
gpu.py's throughput workload, the checkout under test against a baseline.

    VLLM_ACCEL_BASELINE=DIR python3 benchmarks/gpu_ab.py [--rounds 2] [--parts split,ttft,tput,decode1] \
        [--shape tinyllama]

DIR is another checkout (e.g. a git worktree of main before a change); its
``vllm_accel`` runs the baseline. Each measurement is a process of its own,
with one checkout first on PYTHONPATH, and the two alternate:

- ``split``: one ``gpu.host_split`` each (engine core in process): the host's
  microseconds per engine step in vLLM's scheduler, our runner, waiting for
  the GPU.
- ``ttft``: ``--rounds`` rounds of one process per checkout, alternating:
  time to first token (``max_tokens=1``, one request at a time) of prompts
  of TTFT_LENGTHS tokens, 20 of each, median: where a prompt is cut into
  forwards (``plan_forwards``) shows.
- ``decode1``: ``--rounds`` rounds of one process per checkout, alternating:
  the batch-1 decode step (ms; gpu.py's ``decode_step_times``, 10 an engine).
- ``tput``: ``--rounds`` rounds of one process per checkout, in alternating
  order; each times the engine (own process, CUDA graphs, async scheduling)
  and then HF's ``generate`` on the same workload (>= 10 s each), so every
  engine figure has an HF figure from the same process. HF does not depend
  on the checkout: its figures from both arms describe one reference.

Medians with min-max go to ``$OUT/ab_summary.json`` (or ./), every process's
figures to ``ab.json``, its log to ``worker<i>_<label>_<part>.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gpu  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
TTFT_LENGTHS = (100, 200, 300, 370, 450)  # tokens, none a token bucket


def ttft(llm, repeats: int = 20) -> dict:
    """Median time to first token (ms) per prompt length, one request at a
    time, fresh random prompts (no prefix hits)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=1, detokenize=False)
    gen = torch.Generator().manual_seed(1)
    times = {n: [] for n in TTFT_LENGTHS}
    for i in range(repeats + 1):
        for n in TTFT_LENGTHS:
            prompt = torch.randint(2, gpu.SHAPE["vocab_size"], (n,), generator=gen).tolist()
            started = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            if i:  # the first of each length warms the host paths
                times[n].append((time.perf_counter() - started) * 1e3)
    return {str(n): statistics.median(t) for n, t in times.items()}


def worker(label: str, model: str, cache: str, out: str, part: str, shape: str) -> None:
    import vllm_accel

    gpu.SHAPE = dict(gpu.SHAPES[shape])
    prompts = gpu.workload_prompts()
    res = {"label": label, "code": vllm_accel.__file__}
    if part == "split":
        res["host_split"] = gpu.host_split(Path(model), prompts, Path(cache))
    else:
        llm = gpu.engine(Path(model), Path(cache), True, enable_prefix_caching=False)
        if part == "ttft":
            res["ttft_ms"] = ttft(llm)
            gpu.shutdown(llm)
        elif part == "decode1":
            res["decode1_ms"] = [1e3 * s for s in gpu.decode_step_times(llm, prompts, 1, 10)]
            gpu.shutdown(llm)
        else:
            seconds, _ = gpu.timed(gpu.engine_batch(llm, prompts))  # warmed by engine_batch
            res["accel_tok_s"] = gpu.NUM_PROMPTS * gpu.OUTPUT_LEN / seconds
            gpu.shutdown(llm)
            seconds, _ = gpu.timed(gpu.hf_batch(Path(model), prompts))
            res["hf_tok_s"] = gpu.NUM_PROMPTS * gpu.OUTPUT_LEN / seconds
            res["ratio"] = res["accel_tok_s"] / res["hf_tok_s"]
    Path(out).write_text(json.dumps(res))
    print(label, json.dumps(res), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--parts", default="split,tput")
    parser.add_argument("--shape", default="1b", choices=sorted(gpu.SHAPES))
    args = parser.parse_args()
    gpu.SHAPE = dict(gpu.SHAPES[args.shape])
    if "VLLM_ACCEL_BASELINE" not in os.environ:
        sys.exit("gpu_ab.py: set VLLM_ACCEL_BASELINE to the baseline checkout's directory")
    checkouts = {"baseline": os.environ["VLLM_ACCEL_BASELINE"], "this": str(HERE.parent)}
    parts = args.parts.split(",")
    plan = [(label, "split") for label in ("this", "baseline")] if "split" in parts else []
    for part in ("ttft", "tput", "decode1"):
        if part in parts:
            for r in range(args.rounds):
                order = ("baseline", "this") if r % 2 == 0 else ("this", "baseline")
                plan += [(label, part) for label in order]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = gpu.make_model(root / "llama-1b")
        torch.cuda.empty_cache()
        for i, (label, part) in enumerate(plan):
            # The checkout's package first (then the script's directory and
            # whatever the path held: an installation with --target).
            path = [checkouts[label], str(HERE), os.environ.get("PYTHONPATH", "")]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)))
            out = root / f"r{i}.json"
            done = subprocess.run(
                [sys.executable, __file__, "--worker", label, str(model), str(root / "cache"),
                 str(out), part, args.shape], env=env, cwd=checkouts[label], capture_output=True, text=True)
            (OUT / f"worker{i}_{label}_{part}.log").write_text(
                done.stdout[-20000:] + "\n---\n" + done.stderr[-30000:])
            results.append(json.loads(out.read_text()) if done.returncode == 0
                           else {"label": label, "part": part, "failed": done.returncode})
            (OUT / "ab.json").write_text(json.dumps(results, indent=1))
            print("done", label, part, json.dumps(results[-1]), flush=True)
    figures = {}  # name -> median, min, max (gpu.summary) over the rounds
    for label in checkouts:
        mine = [r for r in results if r.get("label") == label]
        series = {f"{label}.{key}": [r[key] for r in mine if key in r]
                  for key in ("accel_tok_s", "hf_tok_s", "ratio")}
        series |= {f"{label}.ttft_ms.{n}": [r["ttft_ms"][str(n)] for r in mine if "ttft_ms" in r]
                   for n in TTFT_LENGTHS}
        series[f"{label}.decode1_ms"] = [ms for r in mine for ms in r.get("decode1_ms", [])]
        figures |= {name: gpu.summary(values) for name, values in series.items() if values}
    # One reference: HF's figures from both arms.
    hf = [r["hf_tok_s"] for r in results if "hf_tok_s" in r]
    if hf:
        figures["hf_tok_s_all"] = gpu.summary(hf)
    print("summary", json.dumps(figures, indent=1), flush=True)
    (OUT / "ab_summary.json").write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:8])
    else:
        main()
