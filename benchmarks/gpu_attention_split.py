"""The cuda backend's attention launch at decode: vLLM's Triton kernel in one
pass (2-D launch) against its split-KV launch (3-D: the context cut into
segments attended side by side, then a merge kernel) for a few segment
counts, on the GPU (run on the accelerator host):

    VLLM_PLUGINS=accel python3 benchmarks/gpu_attention_split.py [--out attention_split.json]

A batch-1 decode step launches it once a layer (compat.triton_paged_attention
with the worker's SplitKvScratch: 16 segments), inside a CUDA graph. So each
variant is timed as the step runs it: 64 launches captured in one graph,
replayed back to back for ``--round-seconds``; rounds alternate the
variants, and a case's rounds together last >= 10 s. Microseconds a launch:
the median of the rounds (min-max). vLLM's kernel chooses its launch from
the shapes: each split variant also reports whether it took the split one.
Shapes: TinyLlama-1.1B's heads (32 / 4 KV, dim 64) and Llama-3.1-8B's (32 /
8, dim 128), bfloat16, 16-token KV blocks, 1 and 8 decoding sequences at
several context lengths.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

HEADS = {"tinyllama": (32, 4, 64), "llama8b": (32, 8, 128)}
CONTEXTS = (128, 512, 2048, 8192)
BATCHES = (1, 8)
SEGMENTS = (None, 4, 8, 16)  # None: the one-pass (2-D) launch
BLOCK = 16
LAUNCHES, ROUNDS = 64, 3


def captured(run) -> torch.cuda.CUDAGraph:
    """LAUNCHES calls of ``run`` captured in one CUDA graph."""
    run()  # Triton compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAUNCHES):
            run()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def round_us(graph: torch.cuda.CUDAGraph, seconds: float) -> float:
    """Microseconds a launch, the graph replayed for about ``seconds``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays, elapsed_ms = 0, 0.0
    while elapsed_ms < 1e3 * seconds:
        start.record()
        for _ in range(100):
            graph.replay()
        end.record()
        end.synchronize()
        replays, elapsed_ms = replays + 100, elapsed_ms + start.elapsed_time(end)
    return 1e3 * elapsed_ms / (replays * LAUNCHES)


def case(heads: int, kv_heads: int, dim: int, batch: int, context: int,
         seconds: float) -> dict:
    from vllm_accel.compat import SplitKvScratch, triton_paged_attention

    blocks_each = context // BLOCK
    dev, dtype = "cuda", torch.bfloat16
    query = torch.randn(batch, heads, dim, device=dev, dtype=dtype)
    out = torch.empty_like(query)
    caches = [torch.randn(batch * blocks_each + 1, BLOCK, kv_heads, dim, device=dev, dtype=dtype)
              for _ in range(2)]
    table = torch.arange(1, 1 + batch * blocks_each, device=dev,
                         dtype=torch.int32).reshape(batch, blocks_each)
    query_start = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    seq_lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
    graphs, outputs, took_split = {}, {}, {}
    for segments in SEGMENTS:
        split = (None if segments is None
                 else SplitKvScratch.allocate(heads, kv_heads, dim, dev, segments))
        if split is not None:
            split.max.fill_(float("nan"))  # vLLM picks the launch: see that it split

        def run(split=split):
            triton_paged_attention(query, *caches, out, query_start, seq_lens, table,
                                   dim ** -0.5, split=split)

        label = "one_pass" if segments is None else f"split_{segments}"
        graphs[label] = captured(run)
        outputs[label] = out.float()
        took_split[label] = split is not None and not split.max.isnan().all().item()
    rounds = {label: [] for label in graphs}
    for _ in range(ROUNDS):
        for label, graph in graphs.items():
            rounds[label].append(round_us(graph, seconds))
    reference = outputs["one_pass"]
    # Every launch computes the same attention.
    return {label: {"median_us": statistics.median(times), "min_us": min(times),
                    "max_us": max(times), "split_launch": took_split[label],
                    "max_abs_diff": (outputs[label] - reference).abs().max().item()}
            for label, times in rounds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="attention_split.json")
    parser.add_argument("--round-seconds", type=float,
                        default=10.0 / (ROUNDS * len(SEGMENTS)) + 0.05)
    args = parser.parse_args()
    report = {"device": torch.cuda.get_device_name(), "launches_a_graph": LAUNCHES,
              "rounds": ROUNDS, "round_seconds": args.round_seconds, "cases": []}
    for shape, (heads, kv_heads, dim) in HEADS.items():
        for batch in BATCHES:
            for context in CONTEXTS:
                results = case(heads, kv_heads, dim, batch, context, args.round_seconds)
                report["cases"].append({"shape": shape, "batch": batch, "context": context,
                                        **results})
                print("attention_split", shape, f"batch={batch}", f"context={context}",
                      " ".join(f"{k}={v['median_us']:.2f}us({v['min_us']:.2f}-{v['max_us']:.2f})"
                               f"diff={v['max_abs_diff']:.1e}"
                               f"{'' if v['split_launch'] or k == 'one_pass' else '(NOT SPLIT)'}"
                               for k, v in results.items()),
                      flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
