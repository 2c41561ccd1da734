"""`vllm serve` of the tiny MolmoE (remote-code config and processor, loaded
with --trust-remote-code from the checkpoint directory) on our platform:
image chat over the OpenAI API answered with the same tokens as the offline
engine (which test_molmoe.py checks against MolmoE's oracle), more images
than --limit-mm-per-prompt answered with a 400 while the server keeps
serving. MolmoE is Molmo's processing, vision adapter and config quirks
(patch 10) with experts in its decoder: the server path is Molmo's; Molmo's
own decoder is checked offline (test_molmo.py, against vLLM's Molmo)."""

from __future__ import annotations

import json

import openai
import pytest

from test_serve import server_env
from test_serve_vision import FAST, GOOD_URL, QUESTION, ask, image_part, text, user, vllm_server
from vllm_accel.testing.tiny_molmoe import make_tiny_molmoe

pytestmark = pytest.mark.slow  # engines and servers: the full suite only

LIMIT = 2


@pytest.fixture(scope="module")
def molmo(tmp_path_factory):
    return make_tiny_molmoe(tmp_path_factory.mktemp("molmoe") / "m")


@pytest.fixture(scope="module")
def server(molmo, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-molmo")
    # trust_remote_code copies the fixture's code into HF_HOME: keep it in tmp.
    env = server_env(**FAST, HF_HOME=str(tmp / "hf"))
    with vllm_server(molmo, tmp, "--dtype", "float32", "--trust-remote-code",
                     "--limit-mm-per-prompt", json.dumps({"image": LIMIT}), env=env) as (base, log):
        yield base, str(molmo), log


def test_image_chat_equals_the_offline_engine(server, client, molmo, tmp_path, monkeypatch):
    from vllm import SamplingParams

    from helpers import running_llm

    _, model, _ = server
    messages = user(image_part(GOOD_URL), text(QUESTION))
    reply = ask(client, model, messages, extra_body={"return_token_ids": True})
    assert reply.choices[0].message.content and reply.choices[0].finish_reason == "length"

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with running_llm(molmo, trust_remote_code=True, max_model_len=4096,
                     limit_mm_per_prompt={"image": LIMIT}) as llm:
        (out,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8),
                          use_tqdm=False)
    assert list(out.prompt_token_ids) == reply.prompt_token_ids
    assert list(out.outputs[0].token_ids) == reply.choices[0].token_ids


def test_too_many_images_is_a_400_and_server_keeps_serving(server, client):
    _, model, _ = server
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, model, user(*[image_part(GOOD_URL)] * (LIMIT + 1), text(QUESTION)))
    assert f"At most {LIMIT} image(s) may be provided in one prompt" in error.value.message
    reply = ask(client, model, user(image_part(GOOD_URL), text(QUESTION)))
    assert reply.usage.completion_tokens == 8
