"""Offline batch evaluation of a vision-language model, the way VLMEvalKit and
eva drive vLLM: every sample through the model's chat template, greedy, all in
one batch, results in input order; a bad sample fails alone.

    .venv/bin/python examples/batch_eval_vision.py [--model DIR] [--input samples.jsonl]
                                                  [--output results.jsonl]
                                                  [--limit-mm-per-prompt N]

Without --model it writes a tiny random-weight LlavaNext (Granite-Vision-like)
checkpoint offline under .cache/. Without --input it evaluates a few generated
images of different sizes and aspect ratios (one sample with two images, one
text-only). An --input line looks like
    {"images": ["cat.png", "dog.jpg"], "question": "Which animal is bigger?"}
("images" may be empty or missing for text-only questions; relative paths are
relative to the JSONL file). Each result line of --output is
{"index", "question", "images", "answer", "error"}, in input order.

A sample that cannot be answered gets "answer": null, an "error" reason and a
"detail" message, and every other sample is still answered: an unreadable
input line (bad_input), a missing image file (image_not_found), a corrupt one
(image_unreadable), more images than --limit-mm-per-prompt or the model allows
(too_many_images), a prompt longer than --max-model-len (prompt_too_long), or
anything else vLLM's input processing rejects (rejected). Images are checked
with PIL before the engine starts; each sample is then rendered and queued on
its own (where vLLM's input processing raises), and the engine runs all queued
samples as one batch. The last line printed is a summary with the failure
counts per reason.
"""

import argparse
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("VLLM_PLUGINS", "accel")

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Sample:
    question: str | None
    labels: list[str]  # image paths as given (or names of the demo images)
    images: list = field(default_factory=list)  # PIL images, loaded
    error: str | None = None  # reason, e.g. "image_not_found"
    detail: str = ""
    answer: str | None = None

    def fail(self, error: str, detail: str) -> None:
        self.error, self.detail, self.images = error, detail, []


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


def default_max_model_len(model: str, trust_remote_code: bool = False) -> int:
    """8192 tokens (room for a few images), or the model's context if shorter."""
    from transformers import AutoConfig

    text_config = AutoConfig.from_pretrained(
        model, trust_remote_code=trust_remote_code).get_text_config()
    return min(8192, getattr(text_config, "max_position_embeddings", 8192))


def default_samples() -> list[Sample]:
    """Square, wide, tall, two images, text only."""
    sizes = {"square 96x96": (96, 96, 4), "wide 200x70": (200, 70, 5),
             "tall 60x180": (60, 180, 4), "small 40x40": (40, 40, 5)}
    image = {name: demo_image(w, h, seed) for name, (w, h, seed) in sizes.items()}
    questions = [
        (["square 96x96"], "What is in this image?"),
        (["wide 200x70"], "Describe the colours."),
        (["tall 60x180"], "Which shape do you see?"),
        (["small 40x40", "wide 200x70"], "Compare the two images."),
        ([], "Name a primary colour."),
    ]
    return [Sample(question, labels, [image[name] for name in labels])
            for labels, question in questions]


def load_image(path: Path):
    """An RGB image; raises if the file is missing or not a readable image."""
    from PIL import Image

    with Image.open(path) as image:
        image.verify()  # the file's structure and checksums, without decoding
    with Image.open(path) as image:  # verify() leaves the image unusable: reopen
        return image.convert("RGB")  # decodes all pixels (truncated data raises)


def read_sample(line: str, base: Path) -> Sample:
    """One JSONL line; a bad line or image makes a failed sample, not an exception."""
    try:
        record = json.loads(line)
        question, paths = record["question"], record.get("images") or []
        if not isinstance(question, str) or not isinstance(paths, list):
            raise ValueError('"question" must be a string and "images" a list')
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        sample = Sample(None, [])
        sample.fail("bad_input", f"{type(e).__name__}: {e}")
        return sample
    sample = Sample(question, [str(p) for p in paths])
    for path in sample.labels:
        try:
            sample.images.append(load_image(base / path))  # relative to the JSONL file
        except FileNotFoundError:
            sample.fail("image_not_found", f"{path}: no such file")
            break
        except Exception as e:  # noqa: BLE001 - PIL raises OSError, SyntaxError, ValueError...
            sample.fail("image_unreadable", f"{path}: {type(e).__name__}: {e}")
            break
    return sample


def read_samples(path: str) -> list[Sample]:
    base = Path(path).parent
    return [read_sample(line, base) for line in Path(path).read_text().splitlines()
            if line.strip()]


def image_limit(value: str) -> int:
    """--limit-mm-per-prompt: 2 or vLLM's own form {"image": 2}."""
    parsed = json.loads(value)
    return parsed["image"] if isinstance(parsed, dict) else int(parsed)


def check_image_counts(samples: list[Sample], limit: int) -> None:
    for sample in samples:
        if sample.error is None and len(sample.images) > limit:
            sample.fail("too_many_images",
                        f"{len(sample.images)} images, at most {limit} per prompt")


def conversation(images: list, question: str) -> list[dict]:
    """One user turn: the images first, then the question (OpenAI content list)."""
    content = [{"type": "image_pil", "image_pil": image} for image in images]
    return [{"role": "user", "content": content + [{"type": "text", "text": question}]}]


def engine_error(e: Exception) -> str:
    """The reason for an exception from vLLM's input processing."""
    message = str(e)
    # vLLM checks the text, its tokens, and the tokens with the images expanded.
    if getattr(e, "parameter", None) in ("input_text", "input_tokens") or any(
            words in message for words in ("maximum context length", "maximum model length")):
        return "prompt_too_long"
    if "may be provided in one prompt" in message:
        return "too_many_images"
    return "rejected"


def answer_all(llm, samples: list[Sample], params) -> None:
    """Queue every good sample on its own, so that a sample vLLM rejects (e.g. a
    prompt longer than max_model_len) fails alone, then run them all as one batch."""
    queued = []
    for sample in samples:
        if sample.error is None:
            try:
                llm.enqueue_chat(conversation(sample.images, sample.question), params,
                                 use_tqdm=False)
                queued.append(sample)
            except Exception as e:  # noqa: BLE001 - any rejection fails this sample only
                sample.fail(engine_error(e), f"{type(e).__name__}: {e}")
    # The outputs come back sorted by request id, i.e. in the order queued.
    outputs = llm.wait_for_completion() if queued else []
    assert len(outputs) == len(queued), (len(outputs), len(queued))
    for sample, output in zip(queued, outputs):
        sample.answer = output.outputs[0].text


def result(index: int, sample: Sample) -> dict:
    line = {"index": index, "question": sample.question, "images": sample.labels,
            "answer": sample.answer, "error": sample.error}
    if sample.error:
        line["detail"] = sample.detail
    return line


def print_results(results: list[dict]) -> None:
    for line in results:
        question = repr(line["question"])
        question = question if len(question) <= 60 else question[:56] + "...'"
        outcome = (repr(line["answer"]) if line["error"] is None
                   else f"failed ({line['error']}): {line['detail']}")
        print(f"[{line['index']}] {question} {line['images']} -> {outcome}")


def summary(samples: list[Sample]) -> dict:
    failures = Counter(sample.error for sample in samples if sample.error)
    return {"samples": len(samples), "answered": len(samples) - sum(failures.values()),
            "failed": sum(failures.values()), "failures": dict(sorted(failures.items()))}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: a tiny LlavaNext)")
    parser.add_argument("--input", help="JSONL samples: {\"images\": [paths], \"question\": ...}")
    parser.add_argument("--output", help="JSONL results (default: print only)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: 8192 or the model's context if shorter")
    parser.add_argument("--limit-mm-per-prompt", type=image_limit, default=None, metavar="N",
                        help='images per prompt, N or {"image": N} (default: the most '
                             "any sample has); samples with more fail")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="for checkpoints whose config/processor is remote code (Molmo)")
    parser.add_argument("--dtype", default="float32", help="e.g. bfloat16 for a large model")
    args = parser.parse_args(argv)

    model = args.model
    if model is None:
        from vllm_accel.testing.fixtures import make_tiny_model

        model = str(make_tiny_model("llava_next", REPO / ".cache" / "tiny-llava_next"))
        print(f"tiny llava_next checkpoint: {model}")
        # A small KV budget is plenty for a tiny model (the default is 4 GiB).
        os.environ.setdefault("VLLM_ACCEL_KVCACHE_SPACE", "1")
    samples = read_samples(args.input) if args.input else default_samples()
    limit = args.limit_mm_per_prompt
    if limit is None:
        limit = max([1] + [len(s.images) for s in samples if s.error is None])
    check_image_counts(samples, limit)

    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype=args.dtype,
        max_model_len=args.max_model_len or default_max_model_len(model, args.trust_remote_code),
        limit_mm_per_prompt={"image": limit},
        trust_remote_code=args.trust_remote_code,
    )
    answer_all(llm, samples, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))

    results = [result(i, sample) for i, sample in enumerate(samples)]
    print_results(results)
    if args.output:
        with open(args.output, "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in results)
        print(f"wrote {len(results)} results to {args.output}")
    counts = summary(samples)
    print(f"summary: {json.dumps(counts)}")
    return counts


if __name__ == "__main__":
    main()
