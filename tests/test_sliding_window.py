"""Sliding-window attention (the tiny Mistral's window, MISTRAL_WINDOW tokens):
vLLM's KV manager frees the blocks a window has left behind, and what the
engine computes over the rest equals HF's (test_generation covers prompts,
chunks, batches and prefix hits past the window for the same fixture)."""

from __future__ import annotations

from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.utils.math_utils import cdiv

from helpers import hf_greedy, model_runner, running_llm
from test_generation import random_prompts
from vllm_accel.testing.tiny_models import MISTRAL_WINDOW


def _decode_recording_blocks(llm, prompt: list[int], max_tokens: int):
    """Run one request to its end, one engine step at a time: its tokens, and
    after each step the real (not null) blocks it holds in each KV cache group."""
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    engine.add_request("long", TokensPrompt(prompt_token_ids=prompt),
                       SamplingParams(temperature=0.0, max_tokens=max_tokens))
    held, tokens = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens = list(output.outputs[0].token_ids)
        if scheduler.requests:
            held.append([_held(manager) for manager in managers])
    return tokens, held


def test_window_frees_blocks_while_decoding_and_matches_hf(tiny_models):
    model_dir = tiny_models["mistral"]
    prompt = random_prompts([150], seed=11)[0]
    with running_llm(model_dir, max_num_batched_tokens=64) as llm:
        block_size = llm.llm_engine.engine_core.engine_core.scheduler.cache_config.block_size
        tokens, held = _decode_recording_blocks(llm, prompt, 24)
    held = [group for (group,) in held]  # one KV cache group
    # Full attention would hold all cdiv(174, bs) blocks by the end; a window
    # of 40 keeps the ones its last window reaches (and one being filled).
    assert max(held[-5:]) <= cdiv(MISTRAL_WINDOW, block_size) + 1 < cdiv(174, block_size)
    assert tokens == hf_greedy(model_dir, [prompt], 24)[0]


def test_windowed_layers_free_their_blocks_while_full_layers_keep_theirs(tiny_models):
    """Granite SWA: layer 0 attends fully, layers 1-3 within a window of
    GRANITE_SWA_WINDOW tokens (vLLM's hybrid KV cache manager: a KV cache
    group per layer here, each with its own blocks). While one long request
    decodes, each windowed group holds only the blocks its window reaches
    (the rest freed: the null block in their place), the full-attention group
    every block of the sequence; the output equals HF's."""
    from vllm_accel.testing.tiny_granite_swa import GRANITE_SWA_WINDOW

    model_dir = tiny_models["granite_swa"]
    prompt = random_prompts([150], seed=12)[0]
    with running_llm(model_dir, max_num_batched_tokens=64) as llm:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        block_size = scheduler.cache_config.block_size
        managers = scheduler.kv_cache_manager.coordinator.single_type_managers
        windows = [getattr(m.kv_cache_spec, "sliding_window", None) for m in managers]
        assert windows == [None] + [GRANITE_SWA_WINDOW] * 3
        tokens, held = _decode_recording_blocks(llm, prompt, 24)
    full, *windowed = zip(*held[-5:])
    assert max(full) == min(full) == cdiv(174, block_size)  # every block of the sequence
    for group in windowed:
        assert max(group) <= cdiv(GRANITE_SWA_WINDOW, block_size) + 1 < cdiv(174, block_size)
    assert tokens == hf_greedy(model_dir, [prompt], 24)[0]


def _held(manager) -> int:
    """Real (not null) blocks the one running request holds in a group."""
    (blocks,) = manager.req_to_blocks.values()
    return sum(not block.is_null for block in blocks)


def test_windows_hold_with_the_hybrid_kv_cache_manager_off(tiny_models):
    """--disable-hybrid-kv-cache-manager: vLLM keeps every layer in one KV
    cache group (no block is freed behind a window); the runner still gives
    the windowed layers a layout with their window, so the output is HF's."""
    from vllm_accel.testing.tiny_granite_swa import GRANITE_SWA_WINDOW

    model_dir = tiny_models["granite_swa"]
    prompts = random_prompts([7, 60, 150], seed=13)
    with running_llm(model_dir, max_num_batched_tokens=64,
                     disable_hybrid_kv_cache_manager=True) as llm:
        runner = model_runner(llm)
        assert runner.kv_cache.attention_groups == [0]
        assert runner.kv_cache.layouts == [(0, 0), (0, GRANITE_SWA_WINDOW)]
        got = [list(o.outputs[0].token_ids) for o in llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)]
    assert got == hf_greedy(model_dir, prompts, 16)
