"""Mistral3 beyond the shared vision parity cases (test_vision_parity.py):
tensor parallelism over two gloo ranks, FMS's strategy sharding the Mistral
decoder (the Pixtral tower whole on each rank): greedy tokens equal HF's
for one image at each size, two images and text only in one batch, in
prefill chunks that end inside images; each image encoded by one rank."""

from __future__ import annotations

import pytest
from test_tensor_parallel_vision import MAX_TOKENS, TP, assert_each_image_encoded_once, tp_engine
from vision_cases import MISTRAL3, cases, expected, hf, model_dir  # noqa: F401 (fixtures)

from helpers import chat_prompt, noise_image, vision_greedy

pytestmark = pytest.mark.slow  # engines with worker processes: the full suite only


@pytest.fixture(scope="module")
def arch():
    return MISTRAL3


def test_mistral3_tp2_matches_hf(model_dir, hf, cases, expected):  # noqa: F811
    processor, _ = hf
    with tp_engine(model_dir, max_num_batched_tokens=MISTRAL3.chunk_tokens) as llm:
        assert {spec.num_kv_heads for rank in llm.collective_rpc("get_kv_cache_spec")
                for spec in rank.values()} == {1}  # 2 KV heads over 2 ranks
        assert vision_greedy(llm, cases, MAX_TOKENS) == expected
        fresh = [(chat_prompt(processor, 2, "Compare them."),
                  [noise_image(100, 70, seed=101), noise_image(64, 128, seed=102)])]
        assert_each_image_encoded_once(llm, lambda: vision_greedy(llm, fresh, 2))
