"""Offline batch evaluation of a vision-language model, the way VLMEvalKit and
eva drive vLLM: every sample through the model's chat template, greedy, all in
one call, results in input order.

    .venv/bin/python examples/batch_eval_vision.py [--model DIR] [--input samples.jsonl]
                                                  [--output results.jsonl]

Without --model it writes a tiny random-weight LlavaNext (Granite-Vision-like)
checkpoint offline under .cache/. Without --input it evaluates a few generated
images of different sizes and aspect ratios (one sample with two images, one
text-only). An --input line looks like
    {"images": ["cat.png", "dog.jpg"], "question": "Which animal is bigger?"}
("images" may be empty or missing for text-only questions; relative paths are
relative to the JSONL file). Each result line of --output is
{"index", "question", "images", "answer"}, in input order.
"""

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("VLLM_PLUGINS", "accel")

REPO = Path(__file__).resolve().parent.parent


def demo_image(width: int, height: int, seed: int):
    """A deterministic picture: a colour gradient with a shape on it."""
    from PIL import Image, ImageDraw

    red, green, blue = (seed * 97) % 256, (seed * 57 + 80) % 256, (seed * 31 + 160) % 256
    image = Image.new("RGB", (width, height))
    image.putdata([(red * x // width, green, blue * y // height)
                   for y in range(height) for x in range(width)])
    box = (width // 4, height // 4, width * 3 // 4, height * 3 // 4)
    draw = ImageDraw.Draw(image)
    (draw.ellipse if seed % 2 else draw.rectangle)(box, fill=(255 - red, 255 - green, 255 - blue))
    return image


def default_max_model_len(model: str) -> int:
    """8192 tokens (room for a few images), or the model's context if shorter."""
    from transformers import AutoConfig

    text_config = AutoConfig.from_pretrained(model).get_text_config()
    return min(8192, getattr(text_config, "max_position_embeddings", 8192))


def default_samples() -> list[tuple[list, str, list[str]]]:
    """(images, question, image labels): square, wide, tall, two images, text only."""
    sizes = {"square 96x96": (96, 96, 4), "wide 200x70": (200, 70, 5),
             "tall 60x180": (60, 180, 4), "small 40x40": (40, 40, 5)}
    image = {name: demo_image(w, h, seed) for name, (w, h, seed) in sizes.items()}
    return [
        ([image["square 96x96"]], "What is in this image?", ["square 96x96"]),
        ([image["wide 200x70"]], "Describe the colours.", ["wide 200x70"]),
        ([image["tall 60x180"]], "Which shape do you see?", ["tall 60x180"]),
        ([image["small 40x40"], image["wide 200x70"]], "Compare the two images.",
         ["small 40x40", "wide 200x70"]),
        ([], "Name a primary colour.", []),
    ]


def read_samples(path: str) -> list[tuple[list, str, list[str]]]:
    from PIL import Image

    samples = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            paths = record.get("images") or []
            # Relative image paths are relative to the JSONL file.
            images = [Image.open(Path(path).parent / p).convert("RGB") for p in paths]
            samples.append((images, record["question"], paths))
    return samples


def conversation(images: list, question: str) -> list[dict]:
    """One user turn: the images first, then the question (OpenAI content list)."""
    content = [{"type": "image_pil", "image_pil": image} for image in images]
    return [{"role": "user", "content": content + [{"type": "text", "text": question}]}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: a tiny LlavaNext)")
    parser.add_argument("--input", help="JSONL samples: {\"images\": [paths], \"question\": ...}")
    parser.add_argument("--output", help="JSONL results (default: print only)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: 8192 or the model's context if shorter")
    parser.add_argument("--dtype", default="float32", help="e.g. bfloat16 for a large model")
    args = parser.parse_args()

    model = args.model
    if model is None:
        from vllm_accel.testing.tiny_models import make_tiny_model

        model = str(make_tiny_model("llava_next", REPO / ".cache" / "tiny-llava_next"))
        print(f"tiny llava_next checkpoint: {model}")
        # A small KV budget is plenty for a tiny model (the default is 4 GiB).
        os.environ.setdefault("VLLM_ACCEL_KVCACHE_SPACE", "1")
    samples = read_samples(args.input) if args.input else default_samples()

    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype=args.dtype,
        max_model_len=args.max_model_len or default_max_model_len(model),
        # The most images any sample has (vLLM rejects prompts with more).
        limit_mm_per_prompt={"image": max([1] + [len(images) for images, _, _ in samples])},
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    # One call for all samples: vLLM batches them itself and returns the
    # outputs in input order.
    outputs = llm.chat([conversation(images, question) for images, question, _ in samples],
                       params)

    results = [
        {"index": i, "question": question, "images": labels, "answer": out.outputs[0].text}
        for i, ((_, question, labels), out) in enumerate(zip(samples, outputs))
    ]
    for result in results:
        print(f"[{result['index']}] {result['question']!r} {result['images']} -> "
              f"{result['answer']!r}")
    if args.output:
        with open(args.output, "w") as f:
            f.writelines(json.dumps(result) + "\n" for result in results)
        print(f"wrote {len(results)} results to {args.output}")


if __name__ == "__main__":
    main()
