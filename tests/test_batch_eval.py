"""examples/batch_eval_vision.py with bad samples among good ones: each bad one
fails alone with its reason, the others are answered, results in input order."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_accel.testing.fixtures import make_tiny_model

pytestmark = pytest.mark.slow  # engines and servers: the full suite only

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "batch_eval_vision.py"

spec = importlib.util.spec_from_file_location("batch_eval_vision", SCRIPT)
batch_eval_vision = importlib.util.module_from_spec(spec)
spec.loader.exec_module(batch_eval_vision)


def write_images(root: Path) -> None:
    from PIL import Image

    Image.new("RGB", (30, 20), (255, 0, 0)).save(root / "red.png")
    Image.new("L", (10, 40), 128).save(root / "gray.png")
    batch_eval_vision.demo_image(64, 48, 3).save(root / "full.png")
    batch_eval_vision.demo_image(400, 300, 2).save(root / "big.png")  # ~270 image tokens
    (root / "not_an_image.png").write_text("hello")
    data = (root / "full.png").read_bytes()
    (root / "truncated.png").write_bytes(data[: len(data) // 2])


# (JSONL line, expected error or None for an answer)
CASES = [
    ({"images": ["red.png"], "question": "What is in this image?"}, None),
    ({"images": ["missing.png"], "question": "And here?"}, "image_not_found"),
    ({"images": ["not_an_image.png"], "question": "Corrupt?"}, "image_unreadable"),
    ({"question": "Name a primary colour."}, None),
    ({"images": ["red.png", "gray.png", "red.png"], "question": "Three?"}, "too_many_images"),
    ({"images": ["truncated.png"], "question": "Truncated?"}, "image_unreadable"),
    ({"question": "Repeat: " + "colour " * 1500}, "prompt_too_long"),
    # Short enough as text (~620 tokens), too long with its two images expanded.
    ({"images": ["big.png", "big.png"], "question": "Describe: " + "colour " * 120},
     "prompt_too_long"),
    ("{not json", "bad_input"),
    ({"images": "red.png", "question": "Images not a list?"}, "bad_input"),
    ({"images": ["gray.png", "full.png"], "question": "Compare the two images."}, None),
]


def write_jsonl(path: Path) -> None:
    lines = [case if isinstance(case, str) else json.dumps(case) for case, _ in CASES]
    path.write_text("\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:]) + "\n")  # a blank line


def test_bad_samples_are_classified_before_the_engine(tmp_path):
    write_images(tmp_path)
    write_jsonl(tmp_path / "samples.jsonl")
    samples = batch_eval_vision.read_samples(str(tmp_path / "samples.jsonl"))
    batch_eval_vision.check_image_counts(samples, limit=2)
    # All but the too-long prompt, which only the engine's processor can measure.
    expected = [error if error != "prompt_too_long" else None for _, error in CASES]
    assert [s.error for s in samples] == expected
    assert [len(s.images) for s in samples] == [1, 0, 0, 0, 0, 0, 0, 2, 0, 0, 2]
    assert {im.mode for s in samples for im in s.images} == {"RGB"}
    assert "missing.png" in samples[1].detail


def run_script(model: Path, samples: Path, output: Path, *options: str,
               **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, VLLM_PLUGINS="accel", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_ACCEL_COMPILE_BACKEND="eager", VLLM_SKIP_WARMUP="1",
               VLLM_ACCEL_KVCACHE_SPACE="0.25", **env_vars)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(model), "--input", str(samples),
         "--output", str(output), "--limit-mm-per-prompt", '{"image": 2}',
         "--max-model-len", "1024", "--max-tokens", "4", *options],
        env=env, cwd=samples.parent, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def test_batch_eval_isolates_bad_samples(tmp_path):
    model = make_tiny_model("llava_next", tmp_path / "llava_next")
    write_images(tmp_path)
    write_jsonl(tmp_path / "samples.jsonl")
    proc = run_script(model, tmp_path / "samples.jsonl", tmp_path / "out.jsonl")

    results = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["index"] for r in results] == list(range(len(CASES)))
    for result, (case, error) in zip(results, CASES):
        if isinstance(case, dict) and error != "bad_input":
            assert result["question"] == case["question"]
            assert result["images"] == case.get("images", [])
        assert result["error"] == error, result
        if error is None:
            assert isinstance(result["answer"], str) and result["answer"].strip(), result
        else:
            assert result["answer"] is None and result["detail"], result
    assert "1024" in results[6]["detail"] and "1024" in results[7]["detail"]

    summary_lines = [line for line in proc.stdout.splitlines() if line.startswith("summary: ")]
    assert summary_lines, proc.stdout[-3000:]
    summary = json.loads(summary_lines[-1].removeprefix("summary: "))
    assert summary == {"samples": 11, "answered": 3, "failed": 8,
                       "failures": {"bad_input": 2, "image_not_found": 1,
                                    "image_unreadable": 2, "prompt_too_long": 2,
                                    "too_many_images": 1}}
    assert f"wrote {len(CASES)} results" in proc.stdout

    # The good samples alone get the same answers: the bad ones did not disturb them.
    good = [case for case, error in CASES if error is None]
    (tmp_path / "good.jsonl").write_text("".join(json.dumps(case) + "\n" for case in good))
    run_script(model, tmp_path / "good.jsonl", tmp_path / "good_out.jsonl")
    alone = [json.loads(line)["answer"]
             for line in (tmp_path / "good_out.jsonl").read_text().splitlines()]
    assert [r["answer"] for r in results if r["error"] is None] == alone
    assert len(set(alone)) == len(alone)  # all different: the order check means something


def test_batch_eval_molmoe(tmp_path):
    """MolmoE (remote code, --trust-remote-code) as the Molmo evaluation runs
    it: one image, two images and text answered in input order; a missing
    image and too many images fail alone."""
    from vllm_accel.testing.tiny_molmoe import make_tiny_molmoe

    model = make_tiny_molmoe(tmp_path / "molmoe")
    write_images(tmp_path)
    picked = [CASES[i] for i in (0, 1, 3, 4, 10)]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(c) + "\n" for c, _ in picked))
    run_script(model, tmp_path / "samples.jsonl", tmp_path / "out.jsonl", "--trust-remote-code",
               HF_HOME=str(tmp_path / "hf"))
    results = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(r["index"], r["error"]) for r in results] == \
        [(i, error) for i, (_, error) in enumerate(picked)]
    answers = [r["answer"] for r in results if r["error"] is None]
    assert len(answers) == 3 and all(isinstance(a, str) and a.strip() for a in answers), results
