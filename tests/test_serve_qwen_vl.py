"""`vllm serve` of the tiny Qwen2.5-VL and Qwen3-VL on our platform (no
torchvision in this environment): image chat over the OpenAI API equal to HF
transformers, bad images and video parts answered with a 400 while the
server keeps serving, and both vision examples pointed at each checkpoint."""

from __future__ import annotations

import base64
import subprocess
import sys

import openai
import pytest

from test_serve import server_env
from test_serve_vision import (
    EXAMPLES,
    FAST,
    QUESTION,
    answer_line,
    ask,
    assert_batch_example_runs,
    assert_image_chat_matches_hf,
    assert_still_serving,
    image_part,
    text,
    two_image_server,
    user,
)
from vision_cases import QWEN2_5_VL, QWEN3_VL

pytestmark = pytest.mark.slow  # engines and servers: the full suite only


@pytest.fixture(scope="module", params=[QWEN2_5_VL, QWEN3_VL], ids=lambda arch: arch.name)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def qwen(arch, tmp_path_factory):
    return arch.make(tmp_path_factory.mktemp(arch.name) / "m")


@pytest.fixture(scope="module")
def server(qwen, tmp_path_factory):
    with two_image_server(qwen, tmp_path_factory.mktemp("serve-qwen")) as served:
        yield served


def test_image_chat_matches_hf(arch, server, client):
    _, model, _ = server
    # Qwen's templates write no bos and their tokenizers add none.
    assert_image_chat_matches_hf(client, model, arch.hf_class, special_tokens=True)


def test_video_part_is_a_400_saying_video_is_not_supported(server, client):
    _, model, _ = server
    video = {"type": "video_url",
             "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(b"x").decode()}}
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, model, user(video, text(QUESTION)))
    assert error.value.status_code == 400
    assert "video" in error.value.message.lower()
    assert_still_serving(client, model)


def test_corrupt_image_is_a_400_and_server_keeps_serving(server, client):
    _, model, _ = server
    bad = "data:image/png;base64," + base64.b64encode(b"no png here").decode()
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, model, user(image_part(bad), text(QUESTION)))
    assert "cannot identify image file" in error.value.message
    assert_still_serving(client, model)


def test_serve_example_asks_a_qwen_server(server):
    base, model, _ = server
    run = subprocess.run([sys.executable, str(EXAMPLES / "serve_vision.py"), "--base-url", base,
                          "--model", model], env=server_env(**FAST), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert answer_line(run.stdout)


def test_batch_example_runs_a_qwen_checkpoint(qwen, tmp_path):
    assert_batch_example_runs(qwen, tmp_path)
