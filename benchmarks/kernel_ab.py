#!/usr/bin/env python3
"""Two builds of our CPU kernels A/B inside one running engine, call by call.

A kernel scratch harness times a layer's shape in isolation; in the engine the
same call runs between other layers' work, with other caches and other memory
than the harness gave it, and the two can disagree by more than the change
being judged (benchmarks/README.md). Here one
engine of this checkout runs a workload while every call of the linear and the
span attention kernels alternates between this checkout's build and
--baseline's (another checkout: its ``vllm_accel/model`` sources, built into a
temporary cache), per call shape. Both builds see the same inputs, one after
the other, minutes of machine drift hit both alike; the first call of each
shape runs both builds and compares their outputs (a packing change between
the builds makes the A/B meaningless: it says so).

Workloads: image prompts (--model: a LlavaNext, Qwen2.5-VL or Molmo
checkpoint; --sizes, --num-prompts, --batches) or, with --text, prompts of
random tokens (--input-len, --output-len).

    .venv/bin/python benchmarks/kernel_ab.py --baseline DIR --model MODEL [--batches 5]

Per kernel and call shape: calls, median ms of each build, the median of
baseline/this ratios of consecutive pairs with its quartiles, and the baseline's
total seconds; then each kernel's totals. Figures above 1: this checkout faster.
"""
import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
sys.path.insert(0, str(Path(__file__).parent))

from _throughput_worker import make_prompts  # noqa: E402
from _vision_worker import throughput_cases  # noqa: E402


class Alternating:
    """Calls go to this build and the baseline's in turn, per call shape."""

    def __init__(self, this, baseline, shape_of):
        self.builds, self.shape_of = (this, baseline), shape_of
        self.turn = collections.Counter()
        self.times = collections.defaultdict(lambda: ([], []))
        self.mismatched: list = []

    def __getattr__(self, name):  # dtypes, pack, ... come from this checkout's build
        return getattr(self.builds[0], name)

    def __call__(self, *args, **kwargs):
        shape = self.shape_of(*args)
        if self.turn[shape] == 0:  # first call of a shape: both builds, outputs compared
            this = self.builds[0](*args, **kwargs).clone()
            if not self.builds[1](*args, **kwargs).equal(this):
                self.mismatched.append(shape)
        which = self.turn[shape] % 2
        self.turn[shape] += 1
        start = time.perf_counter()
        result = self.builds[which](*args, **kwargs)
        self.times[shape][which].append(time.perf_counter() - start)
        return result

    def report(self, name):
        totals = [0.0, 0.0]
        for shape, (this, base) in sorted(self.times.items(), key=lambda kv: -sum(kv[1][1])):
            n = min(len(this), len(base))
            if n < 4:
                continue
            ratios = sorted(b / t for t, b in zip(this[:n], base[:n]))
            totals[0] += sum(this[:n])
            totals[1] += sum(base[:n])
            quartiles = f"[{ratios[n // 4]:.3f}-{ratios[3 * n // 4]:.3f}]"
            print(f"{name} {shape}: {n} pairs, baseline {statistics.median(base) * 1e3:.2f} ms, "
                  f"this {statistics.median(this) * 1e3:.2f} ms, baseline/this "
                  f"{statistics.median(ratios):.3f} {quartiles}, "
                  f"baseline total {sum(base[:n]):.2f} s")
        if totals[0]:
            print(f"{name}, all shapes: baseline {totals[1]:.2f} s, this {totals[0]:.2f} s, "
                  f"baseline/this {totals[1] / totals[0]:.3f}")
        if self.mismatched:
            print(f"{name}: OUTPUTS DIFFER between the builds at {self.mismatched}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="another checkout of vllm-accel")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", type=int, default=5)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--sizes", default="336x336,448x224", help="images, width x height")
    p.add_argument("--text", action="store_true", help="random-token prompts, no images")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    from vllm import LLM, SamplingParams

    import dataclasses

    from vllm_accel.kernels import build as cpu_kernels
    from vllm_accel.kernels import linear as linear_kernel
    from vllm_accel.kernels import span_attention

    extra = {} if a.text else {"limit_mm_per_prompt": {"image": 1}}
    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, seed=0,
              max_num_seqs=a.num_prompts, trust_remote_code=True, **extra)
    # The baseline's sources: kernels/ since the package moved, model/ before.
    sources = Path(a.baseline) / "vllm_accel" / "kernels"
    if not (sources / "linear_kernel.cpp").exists():
        sources = Path(a.baseline) / "vllm_accel" / "model"
    cache = Path(tempfile.mkdtemp(prefix="kernel-ab-"))
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
        .model_runner
    kernels = []
    for field, kernel_class, source, shape_of in (
            ("linear", linear_kernel.LinearKernel, "linear_kernel.cpp",
             lambda x, w, b, n, e=0, *rest: (x.shape[0], x.shape[1], n, e)),
            ("span", span_attention.SpanAttentionKernel, "span_attention.cpp",
             lambda q, *rest: tuple(q.shape))):
        ours = getattr(runner.kernels, field)
        if ours is None:
            print(f"{source}: not in use in this engine")
            continue
        baseline = cpu_kernels.load(kernel_class, sources / source, cache, "-")
        baseline.dtypes = set(ours.dtypes)
        alternating = Alternating(ours, baseline, shape_of)
        runner.kernels = dataclasses.replace(runner.kernels, **{field: alternating})
        kernels.append((source, alternating))

    params = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=0)
    if a.text:
        vocab_size = llm.llm_engine.model_config.get_vocab_size()

        def batch(k):
            return [{"prompt_token_ids": ids} for ids in make_prompts(
                llm.get_tokenizer(), vocab_size, a.num_prompts, a.input_len, a.seed, k)]
    else:
        from transformers import AutoProcessor
        processor = AutoProcessor.from_pretrained(a.model, trust_remote_code=True)

        def batch(k):
            return [{"prompt": prompt, "multi_modal_data": {"image": img}}
                    for prompt, img in throughput_cases(processor, a, k)]
    for k in range(a.batches):
        start = time.perf_counter()
        llm.generate(batch(k), params, use_tqdm=False)
        print(f"batch {k}: {time.perf_counter() - start:.2f} s", flush=True)
    for source, kernel in kernels:
        kernel.report(source)


if __name__ == "__main__":
    main()
