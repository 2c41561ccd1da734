"""A vision-language model on the cuda backend beside HF transformers' own
class, one GPU, one process (run on the accelerator host).

    python benchmarks/gpu_vision.py [--arch qwen3_vl|mistral3] [--text-layers N]
                                    [--vision-layers N] [--rounds 3] [--num-prompts 32]
                                    [--output-len 64] [--out results.json]

- The model: a published config's widths (scripts/real_widths.py's entry:
  Qwen3-VL-4B-Instruct, Mistral-Small-3.1-24B; random weights, bfloat16), at
  full depth unless cut (two 24B models do not fit one 80 GB GPU: cut it).
- Throughput: --num-prompts chat prompts of one image each (random noise;
  sizes in turn from --sizes), --output-len tokens out, never stopping early.
  HF: one batched ``generate`` (its processor pads the prompts on the left);
  vllm-accel: ``LLM.generate`` with CUDA graphs and async scheduling, prefix
  and processor caches off (the same images come again; HF caches neither).
  Each timed run repeats until it lasts >= 10 s; rounds alternate HF /
  vllm-accel; medians with min-max.
- Time to first token: one image (--ttft-size) and a question, one token
  out, median over >= 10 s of requests, each backend in turn.
- Agreement: the first batch's tokens, ours against HF's (bfloat16 near
  ties may part them: reported, not required).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "scripts"))  # real_widths: the published fields
from _vision_worker import chat_prompt, image, parse_sizes  # noqa: E402

MIN_TIMED_S = 10.0
DEVICE = "cuda"  # --device cpu: a smoke run of the script itself


# --arch -> (real_widths.py's entry, the tower's depth field)
ARCHES = {"qwen3_vl": ("qwen3_vl_4b", "depth"), "mistral3": ("mistral3", "num_hidden_layers")}


def write_model(out: Path, arch: str, text_layers: int, vision_layers: int) -> Path:
    """real_widths.py's checkpoint of ``arch`` at this depth, random
    bfloat16 weights made on the GPU."""
    from real_widths import CONFIGS, write_checkpoint

    entry, depth_field = ARCHES[arch]
    fields = CONFIGS[entry][1]
    vision = dict(fields["vision_config"], **{depth_field: vision_layers})
    if "deepstack_visual_indexes" in vision:
        # DeepStack taps as published where the tower keeps them, else its first blocks.
        taps = [i for i in vision["deepstack_visual_indexes"] if i < vision_layers]
        vision["deepstack_visual_indexes"] = taps or list(range(min(3, vision_layers)))
    cut = {"vision_config": vision,
           "text_config": dict(fields["text_config"], num_hidden_layers=text_layers)}
    write_checkpoint(entry, out, torch.bfloat16, cut=cut, device=DEVICE)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


def timed(run) -> float:
    """Seconds per run, repeated until the total lasts >= MIN_TIMED_S."""
    runs, started = 0, time.perf_counter()
    while True:
        run()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        runs += 1
        if time.perf_counter() - started >= MIN_TIMED_S:
            return (time.perf_counter() - started) / runs


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def hf_side(model_dir: Path, cases, output_len: int):
    """HF's batched generate of ``cases`` and its one-token TTFT request, as
    functions to time (each run once here: cuBLAS, the allocator)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(
        model_dir, dtype=torch.bfloat16).to(DEVICE).eval()
    model.generation_config.eos_token_id = None  # as ignore_eos
    batch = processor(text=[p for p, _ in cases], images=[i for _, i in cases],
                      padding=True, return_tensors="pt").to(DEVICE)
    prompt_len = batch.input_ids.shape[1]
    out = {}

    def generate(inputs, tokens):
        with torch.no_grad():
            return model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens,
                                  do_sample=False, pad_token_id=0)

    def run_batch():
        out["tokens"] = generate(batch, output_len)[:, prompt_len:].tolist()

    def run_ttft(case):
        inputs = processor(text=[case[0]], images=[case[1]], return_tensors="pt").to(DEVICE)
        generate(inputs, 1)

    run_batch()
    return run_batch, run_ttft, out


def accel_side(model_dir: Path, cases, output_len: int, cache: Path):
    from vllm import LLM, SamplingParams

    config = {"accel": {"device": DEVICE, "compile_backend": "inductor",
                        "compile_cache_dir": str(cache)}}
    started = time.perf_counter()
    llm = LLM(model=str(model_dir), dtype="bfloat16", max_model_len=2048,
              max_num_seqs=len(cases), gpu_memory_utilization=0.4, seed=0,
              enable_prefix_caching=False, mm_processor_cache_gb=0,  # HF caches neither
              limit_mm_per_prompt={"image": 1, "video": 0},
              additional_config=config)
    start_s = time.perf_counter() - started
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                            detokenize=False)
    requests = [{"prompt": p, "multi_modal_data": {"image": i}} for p, i in cases]
    out = {}

    def run_batch():
        outs = llm.generate(requests, params, use_tqdm=False)
        out["tokens"] = [list(o.outputs[0].token_ids) for o in outs]

    def run_ttft(case):
        llm.generate([{"prompt": case[0], "multi_modal_data": {"image": case[1]}}],
                     SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)

    run_batch()
    return llm, start_s, run_batch, run_ttft, out


def ttft(run_ttft, case) -> dict:
    times, started = [], time.perf_counter()
    while time.perf_counter() - started < MIN_TIMED_S or len(times) < 2:
        begin = time.perf_counter()
        run_ttft(case)
        times.append(time.perf_counter() - begin)
    return {**summary(times[1:]), "runs": len(times) - 1}


def main() -> None:
    global DEVICE, MIN_TIMED_S
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(ARCHES), default="qwen3_vl")
    parser.add_argument("--text-layers", type=int, default=None,
                        help="default: the published depth")
    parser.add_argument("--vision-layers", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--sizes", default="448x448,640x480,480x640,512x512")
    parser.add_argument("--ttft-size", default="448x448")
    parser.add_argument("--out", default="gpu_vision_results.json")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--min-seconds", type=float, default=MIN_TIMED_S)
    args = parser.parse_args()
    DEVICE, MIN_TIMED_S = args.device, args.min_seconds

    from real_widths import CONFIGS

    from vllm_accel.patches import apply_patches

    apply_patches()  # the stand-in video processor, PixtralProcessor (no torchvision)
    root = Path(tempfile.mkdtemp(prefix="gpu-vision-"))
    started = time.perf_counter()
    entry, depth_field = ARCHES[args.arch]
    fields = CONFIGS[entry][1]
    args.text_layers = args.text_layers or fields["text_config"]["num_hidden_layers"]
    args.vision_layers = args.vision_layers or fields["vision_config"][depth_field]
    model_dir = write_model(root / args.arch, args.arch, args.text_layers, args.vision_layers)
    print(f"model written in {time.perf_counter() - started:.1f} s", flush=True)
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    sizes = parse_sizes(args.sizes)
    cases = [(chat_prompt(processor, f"Describe picture {i} in detail."),
              image(0, i, *sizes[i % len(sizes)])) for i in range(args.num_prompts)]
    ttft_case = (chat_prompt(processor, "What is in this picture?"),
                 image(1, 0, *parse_sizes(args.ttft_size)[0]))

    llm, start_s, accel_batch, accel_ttft, accel_out = accel_side(
        model_dir, cases, args.output_len, root / "compile-cache")
    print(f"engine started in {start_s:.1f} s", flush=True)  # a cut run still says where
    started = time.perf_counter()
    hf_batch, hf_ttft, hf_out = hf_side(model_dir, cases, args.output_len)
    print(f"HF loaded and ran one batch in {time.perf_counter() - started:.1f} s", flush=True)
    agree = [next((k for k, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
             for x, y in zip(accel_out["tokens"], hf_out["tokens"])]
    tokens = args.num_prompts * args.output_len
    hf_tps, accel_tps = [], []
    for round_ in range(args.rounds):
        hf_tps.append(tokens / timed(hf_batch))  # the engine is up, idle
        accel_tps.append(tokens / timed(accel_batch))
        print(f"round {round_ + 1}: output tok/s HF {hf_tps[-1]:.0f}, "
              f"vllm-accel {accel_tps[-1]:.0f}", flush=True)
    results = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": {"text_layers": args.text_layers, "vision_layers": args.vision_layers},
        "workload": vars(args), "engine_start_s": start_s,
        "accel_output_tok_s": summary(accel_tps), "hf_output_tok_s": summary(hf_tps),
        "ratio_median": statistics.median(accel_tps) / statistics.median(hf_tps),
        "ttft_accel_s": ttft(accel_ttft, ttft_case), "ttft_hf_s": ttft(hf_ttft, ttft_case),
        "leading_tokens_equal_to_hf": agree,
        "runtime_compiles": llm.collective_rpc("runner_state")[0]["runtime_compiles"],
    }
    print(json.dumps(results, indent=2), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
