#!/usr/bin/env python3
"""Time to first token of two-image prompts under tensor parallelism, and who encoded them.

One engine (tensor_parallel_size=--tp, vLLM's multiprocessing executor), then --requests
prompts of two fresh noise images each (no cache hit), one at a time, max_tokens=1; after
--warmup untimed ones. Prints the median TTFT with its min-max and the images each rank's
encoder ran, so the same script run against another checkout (PYTHONPATH=that checkout)
gives a before/after comparison on one machine.

    .venv/bin/python benchmarks/tp_vision.py [--arch llava_next] [--tp 2] [--size 672x672]

Last line: "tp_vision: arch=... tp=... ttft_ms median=... min=... max=... encoded_per_rank=[...]".
"""
import argparse
import os
import statistics
import tempfile
import time


def _images_encoded(worker):
    return worker.model_runner.vision_encoder.images_encoded


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="llava_next", choices=["llava_next", "qwen2_5_vl", "molmo"])
    p.add_argument("--model", help="checkpoint directory (default: the tiny --arch fixture)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--size", default="672x672", help="WxH of each image")
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args()

    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The engine core in this process: collective_rpc can then send a function.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from _vision_worker import chat_prompt, image
    from transformers import AutoProcessor
    from vllm import LLM, SamplingParams

    from vllm_accel.testing.fixtures import make_tiny_model

    model = a.model or str(make_tiny_model(a.arch, tempfile.mkdtemp() + "/" + a.arch))
    remote = a.arch == "molmo"
    processor = AutoProcessor.from_pretrained(model, trust_remote_code=remote)
    width, height = (int(v) for v in a.size.lower().split("x"))
    llm = LLM(model=model, dtype="float32", max_model_len=2048, tensor_parallel_size=a.tp,
              limit_mm_per_prompt={"image": 2}, trust_remote_code=remote, seed=0)
    content = [{"type": "image"}, {"type": "image"},
               {"type": "text", "text": "Compare these pictures."}]
    templater = processor if getattr(processor, "chat_template", None) else processor.tokenizer
    prompt = templater.apply_chat_template([{"role": "user", "content": content}],
                                           add_generation_prompt=True, tokenize=False)
    params = SamplingParams(temperature=0, max_tokens=1)

    def one(index):
        images = [image(0, 2 * index + k, width, height) for k in range(2)]
        started = time.perf_counter()
        llm.generate([{"prompt": prompt, "multi_modal_data": {"image": images}}], params,
                     use_tqdm=False)
        return time.perf_counter() - started

    for i in range(a.warmup):
        one(i)
    before = llm.collective_rpc(_images_encoded)
    times = [one(a.warmup + i) * 1000 for i in range(a.requests)]
    encoded = [x - y for x, y in zip(llm.collective_rpc(_images_encoded), before)]
    print(f"tp_vision: arch={a.arch} tp={a.tp} size={a.size} requests={a.requests} "
          f"ttft_ms median={statistics.median(times):.1f} min={min(times):.1f} "
          f"max={max(times):.1f} encoded_per_rank={encoded}", flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
