"""LlavaNext (Granite Vision) through our platform against HF transformers'
LlavaNextForConditionalGeneration, token for token (float32), with vLLM's own
processor expanding the prompts."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from helpers import (
    chat_prompt,
    hf_vision_greedy,
    model_runner,
    noise_image,
    running_llm,
    vision_greedy,
)
from vllm_accel.testing.tiny_models import make_tiny_model

MAX_TOKENS = 10
SIZES = [(80, 50), (60, 150), (64, 64), (128, 128), (200, 70)]  # (width, height)
ENGINE = dict(max_model_len=1024, limit_mm_per_prompt={"image": 2}, max_num_seqs=8)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return make_tiny_model("llava_next", tmp_path_factory.mktemp("llava") / "llava_next")


@pytest.fixture(scope="module")
def hf(llava_dir):
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    processor = AutoProcessor.from_pretrained(llava_dir)
    model = LlavaNextForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32)
    return processor, model.eval()


@pytest.fixture(scope="module")
def cases(hf):
    processor, _ = hf
    single = [(chat_prompt(processor, 1, f"Describe picture {i}."), [noise_image(*size)])
              for i, size in enumerate(SIZES)]
    two = [(chat_prompt(processor, 2, "Compare them."), [noise_image(80, 50), noise_image(60, 150)])]
    text = [(chat_prompt(processor, 0, "Tell me a story about a fox."), [])]
    return single + two + text


@pytest.fixture(scope="module")
def llm(llava_dir):
    with running_llm(llava_dir, **ENGINE) as llm:
        yield llm


def test_each_case_matches_hf(llm, hf, cases):
    for prompt, images in cases:
        assert vllm_greedy(llm, [(prompt, images)]) == [hf_greedy(hf, prompt, images)]


def test_mixed_batch_equals_single_requests(llm, hf, cases):
    batched = vllm_greedy(llm, cases)
    assert batched == [vllm_greedy(llm, [case])[0] for case in cases]
    assert batched == [hf_greedy(hf, p, imgs) for p, imgs in cases]


def test_chunk_boundary_inside_an_image(llava_dir, hf):
    processor, _ = hf
    # The 80x50 image takes 168 placeholder tokens from offset 8: 48-token chunks
    # end inside it three times.
    prompt, images = chat_prompt(processor, 1, "What is it?"), [noise_image(80, 50, seed=3)]
    with running_llm(llava_dir, max_num_batched_tokens=48, **ENGINE) as chunked:
        encoder = model_runner(chunked).vision_encoder
        before = encoder.images_encoded  # warmup images
        assert vllm_greedy(chunked, [(prompt, images)]) == [hf_greedy(hf, prompt, images)]
        assert encoder.images_encoded - before == 1  # one image, encoded once across chunks


def test_encoder_runs_once_per_distinct_image_never_in_decode(llm, hf):
    processor, _ = hf
    encoder = model_runner(llm).vision_encoder
    picture = noise_image(128, 64, seed=7)
    before = encoder.images_encoded
    first = chat_prompt(processor, 1, "What colour dominates?")
    # The same image twice in one batch: one encode; 10 decode steps: none.
    assert vllm_greedy(llm, [(first, [picture]), (first, [picture])]) == \
        [hf_greedy(hf, first, [picture])] * 2
    assert encoder.images_encoded - before == 1
    # A later request with the same image and prompt prefix: vLLM reports the
    # image cached (prefix cache / encoder cache), so nothing is encoded.
    again = chat_prompt(processor, 1, "What colour dominates? Answer briefly.")
    assert vllm_greedy(llm, [(again, [picture])]) == [hf_greedy(hf, again, [picture])]
    assert encoder.images_encoded - before == 1


def test_compiled_serving_has_no_recompiles_across_image_sizes(llava_dir, hf, cases,
                                                               tmp_path):
    config = {"accel": {"compile_backend": "inductor", "token_buckets": "1,16,256,2048",
                        "compile_cache_dir": str(tmp_path)}}
    with running_llm(llava_dir, additional_config=config, max_num_batched_tokens=2048,
                     **ENGINE) as llm:
        stats = model_runner(llm).compile_stats
        assert stats.warmup_graphs == 4 + 3  # token buckets + vision tile buckets (2, 4, 5)
        got = vllm_greedy(llm, cases)
        assert stats.runtime_compiles == 0
    assert got == [hf_greedy(hf, p, imgs) for p, imgs in cases]


def test_text_engine_after_a_vision_engine_keeps_no_image_state(llava_dir, tiny_models):
    """A vision engine, then a text engine in the same process (a notebook, this
    suite): the text model's prompts may contain the vision model's image token
    id (6 is an ordinary token of the text tokenizer)."""
    from vllm.exceptions import VLLMValidationError
    from vllm.inputs import TokensPrompt

    with running_llm(llava_dir, **ENGINE) as vision:
        with pytest.raises(VLLMValidationError, match="image token"):
            vision.generate(TokensPrompt(prompt_token_ids=[0, 6, 20, 21]),
                            SamplingParams(max_tokens=1), use_tqdm=False)
    with running_llm(tiny_models["llama"]) as text:
        out = text.generate(TokensPrompt(prompt_token_ids=[0, 6, 20, 21]),
                            SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def hf_greedy(hf, prompt, images, max_tokens=MAX_TOKENS):
    return hf_vision_greedy(hf, prompt, images, max_tokens)


def vllm_greedy(llm, cases, max_tokens=MAX_TOKENS):
    return vision_greedy(llm, cases, max_tokens)
