"""`vllm serve` of the tiny Mistral3 (Pixtral tower) on our platform, without
torchvision: image chat over the OpenAI API equal to HF transformers (prompt
ids too: vLLM's processor expands [IMG] into rows closed by [IMG_BREAK] and
[IMG_END] as HF's does), a corrupt image answered with a 400 while the
server keeps serving, and the batch evaluation example on a Mistral3
checkpoint."""

from __future__ import annotations

import base64

import openai
import pytest

from test_serve_vision import (QUESTION, ask, assert_batch_example_runs,
                               assert_image_chat_matches_hf, assert_still_serving, image_part,
                               text, two_image_server, user)
from vllm_accel.testing.tiny_mistral3 import make_tiny_mistral3

pytestmark = pytest.mark.slow  # engines and servers: the full suite only


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    return make_tiny_mistral3(tmp_path_factory.mktemp("mistral3") / "m")


@pytest.fixture(scope="module")
def server(mistral3, tmp_path_factory):
    with two_image_server(mistral3, tmp_path_factory.mktemp("serve-mistral3")) as served:
        yield served


def test_image_chat_matches_hf(server, client):
    _, model, _ = server
    assert_image_chat_matches_hf(client, model, "Mistral3ForConditionalGeneration")


def test_corrupt_image_is_a_400_and_server_keeps_serving(server, client):
    _, model, _ = server
    bad = "data:image/png;base64," + base64.b64encode(b"no png here").decode()
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, model, user(image_part(bad), text(QUESTION)))
    assert "cannot identify image file" in error.value.message
    assert_still_serving(client, model)


def test_batch_example_runs_a_mistral3_checkpoint(mistral3, tmp_path):
    assert_batch_example_runs(mistral3, tmp_path)
