"""`vllm serve` of the tiny Mistral3 (Pixtral tower) on our platform, without
torchvision: image chat over the OpenAI API equal to HF transformers (prompt
ids too: vLLM's processor expands [IMG] into rows closed by [IMG_BREAK] and
[IMG_END] as HF's does), a corrupt image answered with a 400 while the
server keeps serving, and the batch evaluation example on a Mistral3
checkpoint."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys

import openai
import pytest
import torch

from test_serve import server_env
from test_serve_qwen2_5_vl import assert_still_serving
from test_serve_vision import EXAMPLES, FAST, GOOD_URL, QUESTION, ask, image_part, text, user, \
    vllm_server
from vllm_accel.testing.tiny_mistral3 import make_tiny_mistral3

pytestmark = pytest.mark.slow  # engines and servers: the full suite only


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    return make_tiny_mistral3(tmp_path_factory.mktemp("mistral3") / "m")


@pytest.fixture(scope="module")
def server(mistral3, tmp_path_factory):
    with vllm_server(mistral3, tmp_path_factory.mktemp("serve-mistral3"), "--dtype", "float32",
                     "--max-model-len", "2048", "--limit-mm-per-prompt",
                     json.dumps({"image": 2}), env=server_env(**FAST)) as (base, log):
        yield base, str(mistral3), log


@pytest.fixture()
def client(server):
    base, _, _ = server
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def test_image_chat_matches_hf(server, client, mistral3):
    from PIL import Image
    from transformers import AutoProcessor, Mistral3ForConditionalGeneration

    from vllm_accel.patches import apply_patches

    _, model, _ = server
    reply = ask(client, model, user(image_part(GOOD_URL), text(QUESTION)),
                extra_body={"return_token_ids": True})
    assert reply.choices[0].message.content and reply.choices[0].finish_reason == "length"

    apply_patches()  # PixtralProcessor without torchvision
    processor = AutoProcessor.from_pretrained(mistral3)
    hf = Mistral3ForConditionalGeneration.from_pretrained(mistral3, dtype=torch.float32).eval()
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, text(QUESTION)]}],
        add_generation_prompt=True)
    image = Image.open(io.BytesIO(base64.b64decode(GOOD_URL.split(",", 1)[1])))
    # The chat template writes the BOS token; vLLM's chat endpoint adds none.
    inputs = processor(images=image.convert("RGB"), text=prompt, return_tensors="pt",
                       add_special_tokens=False)
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert reply.prompt_token_ids == inputs.input_ids[0].tolist()
    assert reply.choices[0].token_ids == out[0, inputs.input_ids.shape[1]:].tolist()


def test_corrupt_image_is_a_400_and_server_keeps_serving(server, client):
    _, model, _ = server
    bad = "data:image/png;base64," + base64.b64encode(b"no png here").decode()
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, model, user(image_part(bad), text(QUESTION)))
    assert "cannot identify image file" in error.value.message
    assert_still_serving(client, model)


def test_batch_example_runs_a_mistral3_checkpoint(mistral3, tmp_path):
    out = tmp_path / "results.jsonl"
    run = subprocess.run([sys.executable, str(EXAMPLES / "batch_eval_vision.py"), "--model",
                          str(mistral3), "--output", str(out)],
                         env=server_env(**FAST, VLLM_ENABLE_V1_MULTIPROCESSING="0"),
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in results] == list(range(len(results))) and results
    assert all(r["answer"] for r in results)
