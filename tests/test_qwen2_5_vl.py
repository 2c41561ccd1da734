"""Qwen2.5-VL through our platform against HF transformers'
Qwen2_5_VLForConditionalGeneration, token for token (float32), with vLLM's
own processor expanding the prompts: image sizes that are and are not
multiples of 28 and 112, two images, text only, a mixed batch, a chunk
boundary inside an image, a long output (M-RoPE decode positions), encoder
counts, and compiled serving with padded vision buckets."""

from __future__ import annotations

import pytest
import torch

from helpers import (
    chat_prompt,
    hf_vision_greedy,
    model_runner,
    noise_image,
    running_llm,
    vision_greedy,
)
from vllm_accel.patches import apply_patches
from vllm_accel.testing.tiny_qwen2_5_vl import make_tiny_qwen2_5_vl

MAX_TOKENS = 10
SIZES = [(224, 224), (300, 200), (449, 97), (1000, 60)]  # (width, height)
ENGINE = dict(max_model_len=1024, limit_mm_per_prompt={"image": 2}, max_num_seqs=8)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen") / "qwen2_5_vl")


@pytest.fixture(scope="module")
def hf(qwen_dir):
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    apply_patches()  # the stand-in video processor (no torchvision)
    processor = AutoProcessor.from_pretrained(qwen_dir)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_dir, dtype=torch.float32)
    return processor, model.eval()


@pytest.fixture(scope="module")
def cases(hf):
    processor, _ = hf
    single = [(chat_prompt(processor, 1, f"Describe picture {i}."), [noise_image(*size)])
              for i, size in enumerate(SIZES)]
    two = [(chat_prompt(processor, 2, "Compare them."), [noise_image(300, 200), noise_image(449, 97)])]
    text = [(chat_prompt(processor, 0, "Tell me a story about a fox."), [])]
    return single + two + text


@pytest.fixture(scope="module")
def expected(hf, cases):
    return [hf_greedy(hf, p, imgs) for p, imgs in cases]


@pytest.fixture(scope="module")
def llm(qwen_dir):
    with running_llm(qwen_dir, **ENGINE) as llm:
        yield llm


def test_each_case_matches_hf(llm, cases, expected):
    for case, want in zip(cases, expected):
        assert vllm_greedy(llm, [case]) == [want]


def test_mixed_batch_equals_single_requests_and_hf(llm, cases, expected):
    assert vllm_greedy(llm, cases) == expected


def test_long_output_after_an_image(llm, hf):
    """64 tokens: decode positions continue from the image's M-RoPE delta."""
    processor, _ = hf
    case = (chat_prompt(processor, 1, "Write a long story."), [noise_image(449, 97, seed=5)])
    assert vllm_greedy(llm, [case], 64) == [hf_greedy(hf, *case, max_tokens=64)]


def test_chunk_boundary_inside_an_image(qwen_dir, hf):
    processor, _ = hf
    # 300x200 -> 11x7 merged tokens = 77 image tokens from offset 4: 32-token
    # chunks end inside the image twice.
    case = (chat_prompt(processor, 1, "What is it?"), [noise_image(300, 200, seed=3)])
    with running_llm(qwen_dir, max_num_batched_tokens=32, **ENGINE) as chunked:
        encoder = model_runner(chunked).vision_encoder
        before = encoder.images_encoded
        assert vllm_greedy(chunked, [case]) == [hf_greedy(hf, *case)]
        assert encoder.images_encoded - before == 1  # one image, once across chunks


def test_encoder_once_per_image_never_in_decode(llm, hf):
    processor, _ = hf
    encoder = model_runner(llm).vision_encoder
    picture = noise_image(224, 224, seed=9)
    case = (chat_prompt(processor, 1, "What colour dominates?"), [picture])
    before = encoder.images_encoded
    assert vllm_greedy(llm, [case, case]) == [hf_greedy(hf, *case)] * 2
    assert encoder.images_encoded - before == 1


def test_compiled_serving_pads_vision_buckets_and_never_recompiles(qwen_dir, cases, expected,
                                                                    tmp_path):
    # Coarse vision buckets: every image here is padded (16..256 patches -> 64 or 256).
    config = {"accel": {"compile_backend": "inductor", "token_buckets": "16,256,1024",
                        "multimodal_buckets": "64,256", "compile_cache_dir": str(tmp_path)}}
    with running_llm(qwen_dir, additional_config=config, max_num_batched_tokens=1024,
                     **ENGINE) as llm:
        runner = model_runner(llm)
        assert runner.vision_encoder.buckets == [64, 256]
        stats = runner.compile_stats
        assert stats.warmup_graphs == 3 + 2  # token buckets + vision buckets
        got = vllm_greedy(llm, cases)
        assert stats.runtime_compiles == 0
    assert got == expected


def hf_greedy(hf, prompt, images, max_tokens=MAX_TOKENS):
    return hf_vision_greedy(hf, prompt, images, max_tokens)


def vllm_greedy(llm, cases, max_tokens=MAX_TOKENS):
    return vision_greedy(llm, cases, max_tokens)
