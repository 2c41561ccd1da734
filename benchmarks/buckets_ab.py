"""Token bucket sets side by side in one process: engines that differ only in
``token_buckets``, their requests interleaved one by one (the order flipped
every other request), so the machine's drift hits every set alike.

    .venv/bin/python benchmarks/buckets_ab.py --sets "before=1,8,16,32,48,64,512;default="

- Text time to first token (tiny Llama, float32): one prompt of each of
  ``--lengths`` random tokens, ``max_tokens=1``, ``--requests`` per length.
- Vision time to first token (tiny LlavaNext): one new 336x336 image and a
  question a request.
- Vision batch evaluation: 32 image prompts (336x336, 448x224, 224x448,
  256x256, new images each batch), 32 tokens out, ``--batches`` per set.

Medians with the middle half (p25-p75) or min-max. A set's spec is what
``VLLM_ACCEL_TOKEN_BUCKETS`` takes ("" = the defaults); ``SPEC|estimate``
cuts steps into forwards by the token-count estimate instead of the forward
times warmup measured (``buckets.plan_forwards``):

    .venv/bin/python benchmarks/buckets_ab.py --sets "estimated=|estimate;measured="
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engines in this process
os.environ.setdefault("VLLM_PLUGINS", "accel")

SIZES = [(336, 336), (448, 224), (224, 448), (256, 256)]


def engines(model, sets):
    from vllm import LLM

    from vllm_accel.buckets import token_count_costs

    llms = {}
    for name, spec in sets.items():
        buckets, _, costs = spec.partition("|")
        llms[name] = LLM(model=str(model), dtype="float32", max_model_len=2048, seed=0,
                         enable_prefix_caching=False,
                         additional_config={"accel": {"token_buckets": buckets}})
        runner = (llms[name].llm_engine.engine_core.engine_core.model_executor
                  .driver_worker.worker.model_runner)
        if costs == "estimate":
            runner.forward_costs = token_count_costs(runner.token_buckets)
        costs = runner.forward_costs
        print(f"{name}: token buckets {runner.token_buckets}, forward costs: first "
              f"{[round(c, 4) for c in costs.first]}, later "
              f"{[round(c, 4) for c in costs.later]}", flush=True)
    return llms


def interleaved(llms, make_request, params, count, skip=2):
    """Seconds per call of each engine, calls interleaved (the first ``skip``
    rounds untimed)."""
    times = {name: [] for name in llms}
    for i in range(count + skip):
        request = make_request()
        for name in (list(llms) if i % 2 else list(llms)[::-1]):
            started = time.perf_counter()
            llms[name].generate(request, params, use_tqdm=False)
            if i >= skip:
                times[name].append(time.perf_counter() - started)
    return times


def report(what, times, unit=1e3, suffix="ms"):
    parts = []
    for name, values in times.items():
        v = sorted(x * unit for x in values)
        parts.append(f"{name} {statistics.median(v):.1f} {suffix} "
                     f"(p25-p75 {v[len(v) // 4]:.1f}-{v[3 * len(v) // 4]:.1f}, n={len(v)})")
    print(f"{what}: " + "; ".join(parts), flush=True)


def main():
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_accel.testing.fixtures import make_tiny_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sets", default="before=1,8,16,32,48,64,512;default=")
    p.add_argument("--lengths", default="200,300,370")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--parts", default="text,vision_ttft,vision_batch")
    p.add_argument("--dir", default="/tmp/vllm-accel-buckets-ab")
    a = p.parse_args()
    sets = dict(item.split("=", 1) for item in a.sets.split(";"))
    first = SamplingParams(temperature=0, max_tokens=1)
    if "text" in a.parts:
        llms = engines(make_tiny_model("llama", f"{a.dir}/llama"), sets)
        gen = torch.Generator().manual_seed(0)
        for n in (int(x) for x in a.lengths.split(",")):
            report(f"text TTFT, {n}-token prompt", interleaved(
                llms, lambda: TokensPrompt(prompt_token_ids=torch.randint(
                    10, 300, (n,), generator=gen).tolist()), first, a.requests))
        for llm in llms.values():
            llm.llm_engine.engine_core.shutdown()
    if "vision" in a.parts:
        from _vision_worker import THROUGHPUT, TTFT, chat_prompt, image
        from transformers import AutoProcessor

        model = make_tiny_model("llava_next", f"{a.dir}/llava_next")
        text = chat_prompt(AutoProcessor.from_pretrained(model), "What is in the image?")
        count = itertools.count()  # a new image every request: no cache hits

        def request(phase, width=336, height=336):
            return {"prompt": text,
                    "multi_modal_data": {"image": image(phase, next(count), width, height)}}

        llms = engines(model, sets)
        if "vision_ttft" in a.parts:
            report("LlavaNext TTFT, one 336x336 image", interleaved(
                llms, lambda: request(TTFT), first, a.requests))
        if "vision_batch" in a.parts:
            batch = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
            times = interleaved(
                llms, lambda: [request(THROUGHPUT, *SIZES[i % 4]) for i in range(32)],
                batch, a.batches, skip=1)
            report("LlavaNext batch of 32 image prompts",
                   {name: [32 / t for t in v] for name, v in times.items()}, unit=1,
                   suffix="images/s")


if __name__ == "__main__":
    main()
