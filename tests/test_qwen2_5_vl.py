"""Qwen2.5-VL only: a long output after an image (M-RoPE decode positions)
against HF transformers' Qwen2_5_VLForConditionalGeneration, token for token
(float32). Its parity with HF on the cases LlavaNext shares (image sizes that
are and are not multiples of 28 and 112, two images, text only, a mixed batch,
a chunk boundary inside an image, encoder counts, compiled serving with padded
vision buckets) is in test_vision_parity.py, its numbers in
vision_cases.QWEN2_5_VL."""

from __future__ import annotations

import pytest

from helpers import chat_prompt, hf_vision_greedy, noise_image, vision_greedy
from vision_cases import QWEN2_5_VL, hf, llm, model_dir  # noqa: F401 (hf, llm, model_dir: fixtures)

pytestmark = pytest.mark.slow  # engines and servers: the full suite only


@pytest.fixture(scope="module")
def arch():
    return QWEN2_5_VL


def test_long_output_after_an_image(llm, hf):
    """64 tokens: decode positions continue from the image's M-RoPE delta."""
    processor, _ = hf
    case = (chat_prompt(processor, 1, "Write a long story."), [noise_image(449, 97, seed=5)])
    assert vision_greedy(llm, [case], 64) == [hf_vision_greedy(hf, *case, 64)]
