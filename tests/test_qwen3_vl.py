"""Qwen3-VL only: video refused (a request with one, and an engine whose
limits allow one), and a long output after an image (M-RoPE decode positions)
against HF transformers' Qwen3VLForConditionalGeneration, token for token
(float32). Its parity with HF on the cases every vision architecture shares
(image sizes that are and are not multiples of 32, two images, text only, a
mixed batch, a chunk boundary inside an image, encoder counts, compiled
serving with padded vision buckets and no compile after warmup) is in
test_vision_parity.py, its numbers in vision_cases.QWEN3_VL."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import chat_prompt, hf_vision_greedy, noise_image, running_llm, vision_greedy
from vision_cases import QWEN3_VL, hf, llm, model_dir  # noqa: F401 (hf, llm, model_dir: fixtures)


@pytest.fixture(scope="module")
def arch():
    return QWEN3_VL


def test_an_engine_allowing_video_fails_at_start_up(model_dir):
    with pytest.raises(ValueError, match=r"does not support video inputs for "
                                         r"Qwen3VLForConditionalGeneration"):
        with running_llm(model_dir, limit_mm_per_prompt={"image": 1, "video": 1}):
            pass


@pytest.mark.slow
def test_a_request_with_video_is_refused_and_images_still_served(llm, hf):
    from vllm import SamplingParams

    """vLLM's own refusal of a modality limited to 0 (a VLLMValidationError:
    an HTTP 400 from the server), which the platform set for video."""
    from vllm.exceptions import VLLMValidationError

    processor, _ = hf
    # Frames and their metadata, as vLLM's Qwen3-VL processing takes a video.
    video = (np.zeros((4, 64, 64, 3), dtype=np.uint8),
             {"fps": 2.0, "frames_indices": [0, 1, 2, 3], "total_num_frames": 4, "duration": 2.0})
    prompt = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Hi<|im_end|>\n"
    with pytest.raises(VLLMValidationError, match=r"At most 0 video\(s\)"):
        llm.generate({"prompt": prompt, "multi_modal_data": {"video": video}},
                     SamplingParams(max_tokens=4), use_tqdm=False)
    case = (chat_prompt(processor, 1, "What is it?"), [noise_image(300, 200, seed=4)])
    assert vision_greedy(llm, [case], 8) == [hf_vision_greedy(hf, *case, 8)]


@pytest.mark.slow
def test_long_output_after_an_image(llm, hf):
    """64 tokens: decode positions continue from the image's M-RoPE delta."""
    processor, _ = hf
    case = (chat_prompt(processor, 1, "Write a long story."), [noise_image(449, 97, seed=5)])
    assert vision_greedy(llm, [case], 64) == [hf_vision_greedy(hf, *case, 64)]
