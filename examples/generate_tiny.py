"""The main job, end to end: make a tiny model offline and generate from it with
vLLM through the vllm-accel platform.

    .venv/bin/python examples/generate_tiny.py [--model DIR] [--arch llama|granite]

Without --model it writes a tiny random-weight checkpoint (seconds, no network)
under .cache/; with --model it runs any checkpoint directory vllm-accel supports.
"""

import argparse
import os
from pathlib import Path

# A small KV budget is plenty for a tiny model (the default is 4 GiB).
os.environ.setdefault("VLLM_ACCEL_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_PLUGINS", "accel")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: a tiny model)")
    parser.add_argument("--arch", default="llama", choices=["llama", "granite"])
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()

    model = args.model
    if model is None:
        from vllm_accel.testing.fixtures import make_tiny_model

        out = Path(__file__).resolve().parent.parent / ".cache" / f"tiny-{args.arch}"
        model = str(make_tiny_model(args.arch, out))
        print(f"tiny {args.arch} checkpoint: {model}")

    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", max_model_len=1024)
    prompts = [
        "The capital of France is",
        "Once upon a time, there was a",
        "def fibonacci(n):",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for prompt, output in zip(prompts, llm.generate(prompts, params)):
        print(f"{prompt!r} -> {output.outputs[0].text!r}")

    chat = [{"role": "user", "content": "Say hello in three words."}]
    reply = llm.chat(chat, params)[0].outputs[0].text
    print(f"chat -> {reply!r}")


if __name__ == "__main__":
    main()
