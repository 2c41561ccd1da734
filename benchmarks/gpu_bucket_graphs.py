"""Compiled graphs per token bucket against one graph for the buckets above 1
(``bucket_graphs=per_bucket|shared``) on the cuda backend, side by side on one
GPU (run on the accelerator host):

    VLLM_PLUGINS=accel python3 benchmarks/gpu_bucket_graphs.py [--shape tinyllama] [--rounds 3]

gpu.py's model (random weights, bfloat16) and 64 x (128/128) workload. Both
engines start (each its own empty compile cache: the time is a cold start's
engine, not a fresh process's), then stay up while rounds alternate their
order; each round gives each engine's decode step at batch 1 and 32
(gpu.decode_steps), the median first token of one 448-token prompt over 4 s,
and the workload's output tok/s (timed >= 10 s). Medians over rounds; the
compiles while serving (counters). ``--start``: first gpu.start_times with
``shared`` (fresh processes, cold then warm).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import gpu

VARIANTS = ("per_bucket", "shared")


def first_token_s(llm, prompt: list[int], seconds: float = 4.0) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=1, detokenize=False)
    times, started = [], time.perf_counter()
    while time.perf_counter() - started < seconds:
        begin = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tinyllama", choices=sorted(gpu.SHAPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--start", action="store_true")
    parser.add_argument("--out", default="bucket_graphs.json")
    args = parser.parse_args()
    gpu.SHAPE, gpu.OUTPUT_LEN = dict(gpu.SHAPES[args.shape]), 128
    root = Path(tempfile.mkdtemp(prefix="bucket-graphs-"))
    model = gpu.make_model(root / "model")
    prompts = gpu.workload_prompts()
    long_prompt = (prompts[0] * 4)[:448]  # max_model_len 512 leaves room to sample
    results = {"shape": args.shape}
    if args.start:
        gpu.BUCKET_GRAPHS = "shared"
        results["start_shared"] = gpu.start_times(model, root)
    engines, batches = {}, {}
    for variant in VARIANTS:
        gpu.BUCKET_GRAPHS = variant
        started = time.perf_counter()
        engines[variant] = gpu.engine(model, root / f"cache-{variant}", True,
                                      enable_prefix_caching=False)
        batches[variant] = gpu.engine_batch(engines[variant], prompts)
        results[f"{variant}_engine_s"] = time.perf_counter() - started
        print(variant, "engine up in", results[f"{variant}_engine_s"], flush=True)
    rounds = {v: [] for v in VARIANTS}
    for round_ in range(args.rounds):
        for variant in VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]:
            steps = gpu.decode_steps(engines[variant], prompts)
            seconds, _ = gpu.timed(batches[variant])
            row = {"batch_1_ms": 1e3 * steps["batch_1_s"]["median"],
                   "batch_32_ms": 1e3 * steps["batch_32_s"]["median"],
                   "ttft_448_ms": 1e3 * first_token_s(engines[variant], long_prompt),
                   "output_tok_s": gpu.NUM_PROMPTS * gpu.OUTPUT_LEN / seconds}
            rounds[variant].append(row)
            print("round", round_ + 1, variant, json.dumps(row), flush=True)
    for variant in VARIANTS:
        results[variant] = {key: gpu.summary([r[key] for r in rounds[variant]])
                            for key in rounds[variant][0]}
        state = engines[variant].collective_rpc("runner_state")[0]
        results[variant]["runtime_compiles"] = state["runtime_compiles"]
        gpu.shutdown(engines[variant])
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
