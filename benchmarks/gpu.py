"""vllm-accel's cuda backend against HF transformers' own batched `generate`,
side by side in one process on one GPU (run on the accelerator host).

    python benchmarks/gpu.py [--out results.json] [--rounds 3] [--parts ...] [--variants ...]

- Throughput: a ~1B Llama-shaped model with random weights (hidden 2048, 16
  layers, 32 heads, 8 KV heads, intermediate 5632, vocab 32000; bfloat16),
  64 prompts of 128 random tokens, 64 output tokens each (no early stop),
  greedy; both return token ids (no detokenizing) and the engine's prefix
  cache is off (the same prompts run again and again; HF has none). Rounds
  alternate HF / vllm-accel in one process (the engine, in its own process,
  sits idle while HF runs); each timed run is repeated until it lasts >= 10
  s; medians with min-max, and the ratio also against HF's best round.
  vllm-accel with CUDA graphs and without, with vLLM's async scheduling (the
  default on cuda) and without, each against HF in its own alternation.
- ``--shape moe100m|hybrid100m``: medium_model.py's ~100M Mixtral and Granite
  4 hybrid shapes (float32 checkpoints served in bfloat16, HF's too): the
  mixture-of-experts and Mamba2 layers beside HF's generate.
- Decode step time at batch 1 and 32 (one engine step of decodes, from the
  difference of two output lengths) against the weight-read floor: weight
  bytes / the GPU's measured read bandwidth (a large bfloat16 sum).
- ``--parts decode_env``: the batch-1 decode step under variants of the
  environment (``--env-variants``, e.g. ``TORCHINDUCTOR_ENABLE_PDL=0``), an
  engine per variant and round, rounds alternating variants.
- Engine start, each a fresh process: cold (empty caches), warm, and warm
  with the engine core spawned rather than forked.
- Time to first token of a 512-token prompt against its compute floor (its
  FLOPs at the measured bfloat16 matmul rate).
- Vision TTFT: one 336x336 image on the tiny LlavaNext fixture.
- Profiles (``--parts profile,gpu_profile,host_split``): the host's functions
  over a decode-heavy batch (cProfile); one throughput batch under torch's
  profiler (GPU busy time, top kernels and host ops), then cProfile; the host
  time of an engine step split between vLLM's scheduler, our runner and
  waiting for the GPU (timers, no profiler).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

# The model shapes (random weights): ``--shape``.
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=32000),
    # TinyLlama-1.1B's published widths.
    "tinyllama": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, vocab_size=32000),
    # Llama-3.1-8B's published widths.
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
}
# benchmarks/medium_model.py's mixture-of-experts and Granite 4 hybrid shapes
# (its tiny vocabulary): the new layer kinds on the accelerator beside HF.
MEDIUM_SHAPES = ("moe100m", "hybrid100m")
SHAPE = SHAPES["1b"]  # main() sets the chosen one
NUM_PROMPTS, PROMPT_LEN, OUTPUT_LEN = 64, 128, 64
MIN_TIMED_S = 10.0
TOKEN_BUCKETS = ""  # --token-buckets ("": the product's default)
BUCKET_GRAPHS = "auto"  # --bucket-graphs


def make_medium_model(out: Path, shape: str) -> Path:
    """A medium_model.py shape, its vocabulary size put in ``SHAPE``."""
    from medium_model import make_llama

    make_llama(str(out), shape)
    SHAPE["vocab_size"] = json.loads((out / "config.json").read_text())["vocab_size"]
    return out


def make_model(out: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from vllm_accel.testing.tiny_models import CHAT_TEMPLATE, _save_tokenizer, build_tokenizer

    config = LlamaConfig(**SHAPE, max_position_embeddings=4096, tie_word_embeddings=False,
                         rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, dtype="bfloat16")
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(out)
    _save_tokenizer(build_tokenizer(), out, CHAT_TEMPLATE)  # ids are sent directly
    return out


def timed(run) -> tuple[float, int]:
    """(seconds per run, runs): repeated until the total lasts >= MIN_TIMED_S."""
    runs, started = 0, time.perf_counter()
    while True:
        run()
        torch.cuda.synchronize()
        runs += 1
        elapsed = time.perf_counter() - started
        if elapsed >= MIN_TIMED_S:
            return elapsed / runs, runs


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def engine_options(cache: Path, graphs: bool = True, async_scheduling: str = "auto",
                   **kwargs) -> dict:
    """``LLM()``'s keyword arguments for the benchmark's engines."""
    config = {"accel": {"device": "cuda", "compile_backend": "inductor",
                        "cuda_graphs": graphs, "async_scheduling": async_scheduling,
                        "compile_cache_dir": str(cache), "token_buckets": TOKEN_BUCKETS,
                        "bucket_graphs": BUCKET_GRAPHS}}
    return dict(dtype="bfloat16", max_model_len=512, max_num_seqs=NUM_PROMPTS,
                gpu_memory_utilization=0.35, seed=0, additional_config=config) | kwargs


def engine(model: Path, cache: Path, graphs: bool, async_scheduling: str = "auto", **kwargs):
    from vllm import LLM

    return LLM(model=str(model), **engine_options(cache, graphs, async_scheduling, **kwargs))


def params_like_hf():
    """HF's generate returns token ids: so does the engine (no detokenizing).
    The same prompts run again and again, so the engine's prefix cache is off
    (HF has none): every timed batch prefills all its prompts."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True,
                          detokenize=False)


def shutdown(llm) -> None:
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


# (label, CUDA graphs, async scheduling): each against HF in its own alternation.
VARIANTS = [("cuda_graphs", True, "on"), ("cuda_graphs_sync", True, "off"),
            ("no_cuda_graphs", False, "on"), ("no_cuda_graphs_sync", False, "off")]


def workload_prompts() -> list[list[int]]:
    """The throughput workload's prompts: random token ids, the same every run."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(2, SHAPE["vocab_size"], (NUM_PROMPTS, PROMPT_LEN),
                         generator=gen).tolist()


def hf_batch(model: Path, prompts: list[list[int]]):
    """HF's batched ``generate`` of the workload, as a function to time (run
    once here: cuBLAS and the allocator warm)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(prompts, device="cuda")

    def run_hf():
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=OUTPUT_LEN,
                        min_new_tokens=OUTPUT_LEN, do_sample=False, pad_token_id=0)

    run_hf()
    return run_hf


def engine_batch(llm, prompts: list[list[int]]):
    """The engine's batch of the workload, as a function to time (run once
    here: allocator, graph pools)."""
    from vllm.inputs import TokensPrompt

    params = params_like_hf()
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def run_accel():
        outs = llm.generate(requests, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == OUTPUT_LEN for o in outs)

    run_accel()
    return run_accel


def throughput(model: Path, prompts: list[list[int]], rounds: int, cache: Path,
               variants: list[str]) -> dict:
    started = time.perf_counter()
    run_hf = hf_batch(model, prompts)
    # Progress lines: a run cut by its time limit still says where it was.
    print(f"HF loaded and ran one batch in {time.perf_counter() - started:.1f} s", flush=True)
    results = {}
    tokens = NUM_PROMPTS * OUTPUT_LEN
    for name, graphs, async_scheduling in VARIANTS:
        if name not in variants:
            continue
        started = time.perf_counter()
        llm = engine(model, cache, graphs, async_scheduling, enable_prefix_caching=False)
        run_accel = engine_batch(llm, prompts)
        print(f"{name}: engine started and ran one batch in "
              f"{time.perf_counter() - started:.1f} s", flush=True)
        hf_tps, accel_tps = [], []
        for round_ in range(rounds):
            seconds, _ = timed(run_hf)  # the engine is up, idle
            hf_tps.append(tokens / seconds)
            seconds, _ = timed(run_accel)
            accel_tps.append(tokens / seconds)
            print(f"{name} round {round_ + 1}: output tok/s HF {hf_tps[-1]:.0f}, "
                  f"vllm-accel {accel_tps[-1]:.0f}", flush=True)
        results[name] = {
            "accel_output_tok_s": summary(accel_tps), "hf_output_tok_s": summary(hf_tps),
            "ratio_median": statistics.median(accel_tps) / statistics.median(hf_tps),
            "ratio_vs_best_hf": statistics.median(accel_tps) / max(hf_tps),
            "runtime_compiles": llm.collective_rpc("runner_state")[0]["runtime_compiles"],
        }
        print(name, json.dumps(results[name]), flush=True)
        if graphs:
            results[f"decode_step_{name}"] = decode_steps(llm, prompts)
        shutdown(llm)
    return results  # HF's model goes with this frame


def decode_step_times(llm, prompts, batch: int, repeats: int,
                      outputs: set | None = None) -> list[float]:
    """Seconds per decode step of ``batch`` requests, ``repeats`` times:
    (t(264 tokens) - t(8 tokens)) / 256, after one warm-up run; with
    ``outputs``, each long run's token ids added to it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    requests = [TokensPrompt(prompt_token_ids=p[:16]) for p in prompts[:batch]]

    def seconds(out_len: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        started = time.perf_counter()
        generated = llm.generate(requests, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        if outputs is not None and out_len == 264:
            outputs.add(tuple(tuple(g.outputs[0].token_ids) for g in generated))
        return elapsed

    seconds(8)
    return [(seconds(264) - seconds(8)) / 256 for _ in range(repeats)]


def decode_steps(llm, prompts) -> dict:
    """Seconds per decode step at batch 1 and 32."""
    return {f"batch_{batch}_s": summary(decode_step_times(llm, prompts, batch, 3))
            for batch in (1, min(32, len(prompts)))}  # --num-prompts may hold fewer


def parse_env_variants(text: str) -> list[tuple[str, dict]]:
    """'default;TORCHINDUCTOR_ENABLE_PDL=0' -> labelled environment settings."""
    return [(label, dict(item.split("=", 1) for item in label.split(",") if item != "default"))
            for label in text.split(";")]


def decode_by_env_variant(model: Path, prompts: list[list[int]], root: Path,
                          variants: list[tuple[str, dict]], rounds: int,
                          repeats: int = 10) -> dict:
    """Batch-1 decode step (s) under each variant of the environment (which
    the engine core inherits, forked or spawned): per round an engine per
    variant in turn, each variant with its own compile cache (after round 1
    its graphs load), each engine ``repeats`` differences of two output
    lengths. Also how many of each variant's compiled-code files hold PDL's
    ``gdc_wait`` (kernels that wait on their predecessor), and how many
    distinct greedy outputs its engines gave (compiles that tune block sizes
    apart may round apart)."""
    caches = {label: root / f"cache_{i}" for i, (label, _) in enumerate(variants)}
    steps: dict[str, list[float]] = {label: [] for label, _ in variants}
    outputs: dict[str, set] = {label: set() for label, _ in variants}
    for round_ in range(rounds):
        for label, env in variants:
            with mock.patch.dict(os.environ, env):
                llm = engine(model, caches[label], True, enable_prefix_caching=False)
                steps[label] += decode_step_times(llm, prompts, 1, repeats, outputs[label])
                shutdown(llm)
            print("decode_env", round_, label, statistics.median(steps[label][-repeats:]),
                  flush=True)
    out = {}
    for label, _ in variants:
        out[label] = summary(steps[label]) | {
            "steps": len(steps[label]),
            "files_with_gdc_wait": sum(
                "gdc_wait" in path.read_text(errors="ignore")
                for path in caches[label].rglob("*.py")),
            "distinct_outputs": len(outputs[label])}
    return out


def weight_read_floor(model: Path) -> dict:
    from safetensors import safe_open

    weight_bytes = 0  # bfloat16: 2 bytes a weight
    for path in model.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            weight_bytes += sum(2 * math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    x = torch.empty(4 * 2**30 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    x.sum()
    torch.cuda.synchronize()
    started, reps = time.perf_counter(), 20
    for _ in range(reps):
        x.sum()
    torch.cuda.synchronize()
    bandwidth = reps * x.numel() * 2 / (time.perf_counter() - started)
    del x
    return {"weight_bytes": weight_bytes, "read_bandwidth_gb_s": bandwidth / 1e9,
            "floor_s": weight_bytes / bandwidth}


def matmul_rate(size: int = 8192, reps: int = 50) -> float:
    """The GPU's measured bfloat16 matmul rate (FLOP/s) on square products."""
    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * size ** 3 * reps / (time.perf_counter() - started)


def prefill_flops(tokens: int) -> float:
    """A prompt's forward: every layer's linears on each token, causal
    attention (QK^T and PV over the earlier tokens), the LM head on the last."""
    s = SHAPE
    hidden, layers = s["hidden_size"], s["num_hidden_layers"]
    head_dim = hidden // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * head_dim
    per_layer = hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * s["intermediate_size"]
    attention = 2 * 2 * layers * hidden * tokens * (tokens + 1) / 2
    return 2 * layers * per_layer * tokens + attention + 2 * hidden * s["vocab_size"]


def ttft(model: Path, cache: Path, prompt_len: int = 512) -> dict:
    """Time to first token of one ``prompt_len``-token prompt (the engine's
    whole path: schedule, forward, sample, output), against its compute
    floor: its FLOPs at the measured bfloat16 matmul rate."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = engine(model, cache, True, max_model_len=2 * prompt_len, max_num_seqs=8,
                 max_num_batched_tokens=2 * prompt_len, enable_prefix_caching=False)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, SHAPE["vocab_size"], (prompt_len,), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=1, detokenize=False)

    def run():
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)

    run()
    times = []
    started = time.perf_counter()
    while time.perf_counter() - started < MIN_TIMED_S:
        begin = time.perf_counter()
        run()
        times.append(time.perf_counter() - begin)
    shutdown(llm)
    rate = matmul_rate()
    floor = prefill_flops(prompt_len) / rate
    out = {"prompt_tokens": prompt_len, "ttft_s": summary(times), "runs": len(times),
           "matmul_tflops": rate / 1e12, "compute_floor_s": floor,
           "ratio_to_floor": statistics.median(times) / floor}
    return out


def decode_only(model: Path, prompts: list[list[int]], cache: Path) -> dict:
    """The decode step at batch 1 and 32 (CUDA graphs, async scheduling)."""
    llm = engine(model, cache, True, enable_prefix_caching=False)
    out = decode_steps(llm, prompts)
    shutdown(llm)
    return out


def start_times(model: Path, root: Path, rounds: int = 1, spawned: bool = True,
                baseline: Path | None = None) -> dict:
    """Engine start-up as a user's script meets it: each start a fresh process
    (startup.py's), vLLM's import and ``LLM()`` timed apart, the warmup's parts
    from the engine's log. Per round: cold (empty compile, Triton, inductor and
    vLLM caches), warm (the same caches again), and warm with the engine core
    spawned (vLLM's choice where the front-end process has initialized CUDA;
    not with ``spawned=False``). With ``baseline`` (another checkout), each
    round also starts that checkout's vllm_accel the same way (its results
    under ``baseline_*``), the two in turn, the first alternating by round."""
    from common import REPO
    from startup import start_once

    checkouts = [("", REPO)] + ([("baseline_", baseline.resolve())] if baseline else [])
    out = {}
    for round_ in range(rounds):
        for prefix, checkout in checkouts if round_ % 2 == 0 else checkouts[::-1]:
            caches = root / f"start-caches-{prefix}{round_}"
            options = engine_options(caches / "compile")
            env = {**os.environ, "TRITON_CACHE_DIR": str(caches / "triton"),
                   "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
                   "VLLM_CACHE_ROOT": str(caches / "vllm")}
            env.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
            starts = [("cold", {}), ("warm", {})]
            if spawned:
                starts.append(("warm_spawn", {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}))
            for label, extra in starts:
                log = root / f"start-{prefix}{label}-{round_}.log"
                try:
                    # The checkout's package first: `python -c` puts the cwd first on the path.
                    result = start_once(sys.executable, {**env, **extra}, str(model), log,
                                        cwd=checkout, options=options)
                except SystemExit as failed:  # start_once exits with the log's tail
                    result = {"failed": str(failed)[-3000:]}
                out.setdefault(prefix + label, []).append(result)
                print("start", prefix + label, json.dumps(result), flush=True)
                if log.exists():  # deleted with root: keep our lines
                    print("".join(line for line in log.read_text().splitlines(keepends=True)
                                  if "vllm_accel" in line or "init engine" in line), flush=True)
    for label, results in out.items():
        seconds = [r["llm_s"] for r in results if "llm_s" in r]
        if seconds:
            print("start", label, "LLM() s", json.dumps(summary(seconds)), flush=True)
    return out


def vision_ttft_llava(root: Path, rounds: int = 10) -> dict:
    import numpy as np
    from PIL import Image
    from vllm import LLM, SamplingParams

    from vllm_accel.testing.fixtures import make_tiny_model

    path = make_tiny_model("llava_next", root / "llava")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (336, 336, 3),
                                                              dtype=np.uint8))
    config = {"accel": {"device": "cuda", "compile_backend": "inductor",
                        "compile_cache_dir": str(root / "vision-cache")}}
    llm = LLM(model=str(path), dtype="float32", max_model_len=2048, seed=0,
              gpu_memory_utilization=0.2, limit_mm_per_prompt={"image": 1},
              additional_config=config)
    prompt = {"prompt": "<|start_header_id|>user<|end_header_id|>\n\n<image>\nDescribe."
                        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
              "multi_modal_data": {"image": image}}
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([prompt], params, use_tqdm=False)
    times = []
    for i in range(rounds):
        # A new image each time: no encoder or prefix cache hit.
        prompt["multi_modal_data"]["image"] = Image.fromarray(
            np.random.default_rng(i + 1).integers(0, 256, (336, 336, 3), dtype=np.uint8))
        started = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        times.append(time.perf_counter() - started)
    shutdown(llm)
    return {"ttft_s": summary(times)}


def print_host_profile(llm, requests, params) -> None:
    """Where one ``generate``'s host time goes, by Python function (vLLM's
    scheduler and ours; cProfile, top functions)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate(requests, params, use_tqdm=False)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)


def profile_decode(model: Path, prompts: list[list[int]], cache: Path) -> None:
    """Where a decode-heavy batch's time goes on the host."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = engine(model, cache, True)
    reqs = [TokensPrompt(prompt_token_ids=p[:16]) for p in prompts[:32]]
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    llm.generate(reqs, params, use_tqdm=False)
    print_host_profile(llm, reqs, params)
    shutdown(llm)


def gpu_profile(model: Path, prompts: list[list[int]], cache: Path,
                output_len: int | None = None) -> None:
    """Where one throughput batch's time goes (torch profiler, engine core in
    this process): wall time against the GPU's busy time, the kernels that
    take it and the host functions around them."""
    from torch.profiler import ProfilerActivity, profile
    from vllm.inputs import TokensPrompt

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = engine(model, cache, True, enable_prefix_caching=False)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = params_like_hf()
    if output_len is not None:
        params.max_tokens = output_len
    for _ in range(2):
        llm.generate(requests, params, use_tqdm=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        llm.generate(requests, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"gpu_profile: wall {wall * 1e3:.1f} ms, kernels {gpu_us / 1e3:.1f} ms "
          f"({100 * gpu_us / 1e6 / wall:.0f} % busy), {kernels} kernel runs, "
          f"{len(prompts) * params.max_tokens / wall:.0f} tok/s")
    print(events.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    if output_len is not None:  # decodes of one request: one step's kernels, in order
        print_one_step(prof, kernels // params.max_tokens)
    print_host_profile(llm, requests, params)
    shutdown(llm)
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")


def print_one_step(prof, per_step: int) -> None:
    """The kernels of one decode step from the middle of a profile (the
    steps are alike), in launch order, with their GPU time and the gap
    before each."""
    kernels = sorted((e for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    middle = len(kernels) // 2
    step = kernels[middle:middle + per_step]
    busy = sum(e.time_range.elapsed_us() for e in step)
    span = step[-1].time_range.end - step[0].time_range.start
    print(f"one_step: {len(step)} kernels, {busy:.0f} us busy over {span:.0f} us")
    previous = step[0].time_range.start
    for e in step:
        print(f"one_step {e.time_range.start - previous:6.1f} gap "
              f"{e.time_range.elapsed_us():6.1f} us  {e.name[:90]}")
        previous = e.time_range.end


def host_split(model: Path, prompts: list[list[int]], cache: Path, batches: int = 5,
               output_len: int | None = None) -> dict:
    """Where an engine step's wall time goes on the host (engine core in this
    process, throughput batches): mean microseconds per step in vLLM's
    scheduler, in our runner (and the parts of it: layout, input copy, graph
    launch, sampler, ...) and waiting for the GPU's tokens; the rest is vLLM's
    engine loop and output processing."""
    import collections

    from vllm.inputs import TokensPrompt

    from vllm_accel.worker import model_runner, sampling
    from vllm_accel.worker.cuda_graphs import ForwardGraphs
    from vllm_accel.worker.forward_inputs import ForwardInputs
    from vllm_accel.worker.in_flight import InFlightOutput

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = engine(model, cache, True, enable_prefix_caching=False)
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    seconds, calls = collections.defaultdict(float), collections.Counter()

    def timed(owner, name, label):
        function = getattr(owner, name)

        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - started
                calls[label] += 1

        setattr(owner, name, wrapper)

    timed(core.scheduler, "schedule", "vllm_schedule")
    timed(core.scheduler, "update_from_output", "vllm_update_from_output")
    timed(runner, "execute_model", "runner_execute_model")
    timed(runner, "sample_tokens", "runner_sample_tokens")
    timed(ForwardGraphs, "replay", "graph_replay (in execute_model)")
    timed(InFlightOutput, "get_output", "waiting_for_tokens (get_output)")
    # Inside execute_model and sample_tokens.
    timed(runner.requests, "update", "execute_model.requests_update")
    timed(model_runner, "pack_step", "execute_model.pack_step")
    timed(model_runner, "tokens_in_flight", "execute_model.tokens_in_flight")
    timed(ForwardInputs, "send", "execute_model.send")
    timed(sampling, "sample", "sample_tokens.vllm_sampler")
    timed(runner.requests, "append_tokens", "sample_tokens.append_tokens")
    timed(InFlightOutput, "__init__", "sample_tokens.in_flight_output")
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = params_like_hf()
    if output_len is not None:
        params.max_tokens = output_len
    llm.generate(requests, params, use_tqdm=False)
    seconds.clear()
    calls.clear()
    started = time.perf_counter()
    for _ in range(batches):
        llm.generate(requests, params, use_tqdm=False)
    wall = time.perf_counter() - started
    steps = calls["vllm_schedule"]
    out = {"steps": steps, "step_wall_us": 1e6 * wall / steps,
           **{label: 1e6 * total / steps for label, total in seconds.items()}}
    print("host_split (us per engine step)", json.dumps(out), flush=True)
    shutdown(llm)
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    return out


PEER_SCRIPT = """
import json, os, statistics, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
model, prompts, output_len, options = json.loads(sys.argv[1])
llm = LLM(model=model, dtype="bfloat16", max_model_len=512, max_num_seqs=len(prompts),
          gpu_memory_utilization=0.35, seed=0, enable_prefix_caching=False, **options)
params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=False)
requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
llm.generate(requests, params, use_tqdm=False)
rates = []
for _ in range(3):
    runs, started = 0, time.perf_counter()
    while time.perf_counter() - started < 10:
        llm.generate(requests, params, use_tqdm=False)
        runs += 1
    rates.append(runs * len(prompts) * output_len / (time.perf_counter() - started))
one = [TokensPrompt(prompt_token_ids=prompts[0][:16])]
def seconds(n):
    started = time.perf_counter()
    llm.generate(one, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - started
seconds(8)
steps = sorted((seconds(264) - seconds(8)) / 256 for _ in range(3))
print("PEER_RESULT", json.dumps({"output_tok_s": rates, "batch_1_step_s": steps}), flush=True)
"""


def vllm_gpu_peer(model: Path, prompts: list[list[int]]) -> dict:
    """vLLM's own GPU model runner from the same vLLM build (no platform
    plugin: VLLM_PLUGINS empty), CUDA graphs, the same max_num_seqs and dtype,
    its custom ops on their native (PyTorch) paths and its Triton attention
    backend, as the pure-Python build has no compiled ``_C`` ops. In its own
    process; returns its figures, or the error that stopped it."""
    import subprocess

    env = dict(os.environ, VLLM_PLUGINS="", VLLM_ATTENTION_BACKEND="TRITON_ATTN")
    options = {"compilation_config": {"custom_ops": ["none"]}}
    argument = json.dumps([str(model), prompts, OUTPUT_LEN, options])
    done = subprocess.run([sys.executable, "-c", PEER_SCRIPT, argument], env=env,
                          capture_output=True, text=True, timeout=540)
    for line in done.stdout.splitlines():
        if line.startswith("PEER_RESULT "):
            figures = json.loads(line.removeprefix("PEER_RESULT "))
            return {"output_tok_s": summary(figures["output_tok_s"]),
                    "batch_1_step_s": summary(figures["batch_1_step_s"])}
    log = (done.stdout + done.stderr).splitlines()
    errors = [line for line in log if "Error" in line or "error" in line]
    return {"failed": True, "returncode": done.returncode, "errors": errors[-15:],
            "tail": log[-40:]}


def hf_static_compiled(model: Path, prompts: list[list[int]]) -> dict:
    """transformers' own static-cache generate, compiled by generate itself
    (a static cache makes it compile the decoding forward, its documented
    path), at batch 1 and the workload's batch: output tok/s, or the error."""
    from transformers import AutoModelForCausalLM, CompileConfig

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda().eval()
    out = {}
    for label, compile_config in (("reduce_overhead", CompileConfig(mode="reduce-overhead")),
                                  ("default_mode", CompileConfig(mode="default"))):
        for batch in (1, NUM_PROMPTS):
            ids = torch.tensor(prompts[:batch], device="cuda")

            def run():
                with torch.no_grad():
                    hf.generate(ids, attention_mask=torch.ones_like(ids),
                                max_new_tokens=OUTPUT_LEN, min_new_tokens=OUTPUT_LEN,
                                do_sample=False, pad_token_id=0, cache_implementation="static",
                                compile_config=compile_config)
            try:
                run()
                run()
                seconds, _ = timed(run)
                out[f"{label}_batch_{batch}_tok_s"] = batch * OUTPUT_LEN / seconds
            except Exception as error:  # the peer's failure is the figure
                out[f"{label}_batch_{batch}_error"] = f"{type(error).__name__}: {error}"[:500]
            print("hf_static", label, batch, out, flush=True)
    del hf
    torch.cuda.empty_cache()
    return out


def main() -> None:
    global SHAPE, OUTPUT_LEN, NUM_PROMPTS, TOKEN_BUCKETS, BUCKET_GRAPHS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="gpu_results.json")
    parser.add_argument("--parts", default="throughput,floor,start,vision",
                        help="any of throughput, decode, decode_env, ttft, floor, start, vision, peers "
                             "(vLLM's GPU "
                             "runner, HF's compiled static-cache generate), profile, "
                             "gpu_profile, host_split")
    parser.add_argument("--shape", default="1b", choices=sorted(SHAPES) + list(MEDIUM_SHAPES))
    parser.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    parser.add_argument("--start-rounds", type=int, default=1,
                        help="rounds of engine starts (cold, warm, warm with spawn)")
    parser.add_argument("--baseline", default="",
                        help="start: another checkout, started the same way in turn")
    parser.add_argument("--no-spawned-start", action="store_true",
                        help="rounds of cold and warm starts only")
    parser.add_argument("--num-prompts", type=int, default=NUM_PROMPTS,
                        help="the throughput batch (HF's torch-only Mamba2 scan needs ~50 GB "
                             "for hybrid100m's 64 x 128-token prefill)")
    parser.add_argument("--variants", default=",".join(v[0] for v in VARIANTS),
                        help="throughput variants: CUDA graphs or not, async scheduling "
                             "(on) or not (_sync)")
    parser.add_argument("--token-buckets", default="",
                        help="the engine's token buckets (default: the product's); the "
                             "throughput part runs the batch's bucket (decodes) and the "
                             "largest (prefill) only, so '1,16,512' with --num-prompts 16 "
                             "times the same graphs with fewer compiles at a cold start")
    parser.add_argument("--bucket-graphs", default="auto",
                        choices=("auto", "per_bucket", "shared"),
                        help="compiled graphs: one per token bucket, or one for buckets above 1")
    parser.add_argument("--env-variants", default="default;TORCHINDUCTOR_ENABLE_PDL=0",
                        help="decode_env: ';'-separated variants of the environment, each "
                             "'NAME=VALUE,...' or 'default'")
    parser.add_argument("--in-process", action="store_true",
                        help="engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): "
                             "no overlap of vLLM's output processing with the engine's steps")
    args = parser.parse_args()
    SHAPE, OUTPUT_LEN = dict(SHAPES.get(args.shape, {})), args.output_len
    NUM_PROMPTS, TOKEN_BUCKETS = args.num_prompts, args.token_buckets
    BUCKET_GRAPHS = args.bucket_graphs
    parts = args.parts.split(",")
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "shape": args.shape, "workload": f"{NUM_PROMPTS} x ({PROMPT_LEN}/{OUTPUT_LEN})",
               "engine_core": "in process" if args.in_process else "own process (vLLM's default)"}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = (make_medium_model(root / args.shape, args.shape) if args.shape in MEDIUM_SHAPES
                 else make_model(root / "llama-1b"))
        prompts = workload_prompts()
        if "floor" in parts:
            results["weight_read_floor"] = weight_read_floor(model)
            print("floor", results["weight_read_floor"], flush=True)
        if "start" in parts:
            results["engine_start"] = start_times(
                model, root, args.start_rounds, not args.no_spawned_start,
                Path(args.baseline) if args.baseline else None)
            print("start", results["engine_start"], flush=True)
        if "decode" in parts:
            results["decode_step"] = decode_only(model, prompts, root / "cache")
            print("decode", results["decode_step"], flush=True)
        if "decode_env" in parts:
            results["decode_by_env_variant"] = decode_by_env_variant(
                model, prompts, root, parse_env_variants(args.env_variants), args.rounds)
            print("decode_env", results["decode_by_env_variant"], flush=True)
        if "ttft" in parts:
            results["ttft"] = ttft(model, root / "cache")
            print("ttft", results["ttft"], flush=True)
        if "throughput" in parts:
            results.update(throughput(model, prompts, args.rounds, root / "cache",
                                       args.variants.split(",")))
        if "peers" in parts:
            results["vllm_gpu_runner"] = vllm_gpu_peer(model, prompts)
            print("vllm_gpu_runner", json.dumps(results["vllm_gpu_runner"]), flush=True)
            results["hf_static_compiled"] = hf_static_compiled(model, prompts)
        if "profile" in parts:
            profile_decode(model, prompts, root / "cache")
        if "gpu_profile" in parts:
            gpu_profile(model, prompts, root / "cache")
        if "gpu_profile_1" in parts:  # one request decoding
            gpu_profile(model, prompts[:1], root / "cache", output_len=256)
        if "host_split" in parts:
            results["host_split"] = host_split(model, prompts, root / "cache")
        if "host_split_1" in parts:  # one request decoding: the batch-1 step
            results["host_split_1"] = host_split(model, prompts[:1], root / "cache",
                                                 batches=3, output_len=256)
        if "vision" in parts:
            results["vision"] = vision_ttft_llava(root)
            print("vision", results["vision"], flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
