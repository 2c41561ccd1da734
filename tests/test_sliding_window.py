"""Sliding-window attention (the tiny Mistral's window, MISTRAL_WINDOW tokens):
vLLM's KV manager frees the blocks a window has left behind, and what the
engine computes over the rest equals HF's (test_generation covers prompts,
chunks, batches and prefix hits past the window for the same fixture)."""

from __future__ import annotations

from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.utils.math_utils import cdiv

from helpers import hf_greedy, running_llm
from test_generation import random_prompts
from vllm_accel.testing.tiny_models import MISTRAL_WINDOW


def _blocks_held(scheduler) -> int:
    """The blocks the one running request holds that are real (not vLLM's
    null block, which stands for the ones freed)."""
    (manager,) = scheduler.kv_cache_manager.coordinator.single_type_managers
    (blocks,) = manager.req_to_blocks.values()
    return sum(not block.is_null for block in blocks)


def test_window_frees_blocks_while_decoding_and_matches_hf(tiny_models):
    model_dir = tiny_models["mistral"]
    prompt = random_prompts([150], seed=11)[0]
    with running_llm(model_dir, max_num_batched_tokens=64) as llm:
        engine = llm.llm_engine
        scheduler = engine.engine_core.engine_core.scheduler
        block_size = scheduler.cache_config.block_size
        engine.add_request("long", TokensPrompt(prompt_token_ids=prompt),
                           SamplingParams(temperature=0.0, max_tokens=24))
        held, tokens = [], None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    tokens = list(output.outputs[0].token_ids)
            if scheduler.requests:
                held.append(_blocks_held(scheduler))
    # Full attention would hold all cdiv(174, bs) blocks by the end; a window
    # of 40 keeps the ones its last window reaches (and one being filled).
    assert max(held[-5:]) <= cdiv(MISTRAL_WINDOW, block_size) + 1 < cdiv(174, block_size)
    assert tokens == hf_greedy(model_dir, [prompt], 24)[0]
