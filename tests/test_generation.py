"""Greedy output of our platform against HF transformers, token for token
(float32), through vLLM's offline API: single prompts, batches, chunked
prefill, prefix caching and requests that arrive while others decode; and
for a model whose layers keep recurrent state (Bamba's Mamba2), requests
preempted and computed again. The Mamba2 hybrids (Bamba; Granite 4, with experts)
run with prefix caching off (documented), which their prefix test asserts."""

from __future__ import annotations

import random

import pytest
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from helpers import hf_greedy, model_runner, running_llm

MAX_TOKENS = 16
# A chunk budget well below the longest prompt, so long prompts prefill in chunks.
ENGINE_OPTIONS = dict(max_num_batched_tokens=128, max_num_seqs=16)


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # ids 6.. are ordinary tokens in the tiny tokenizer (0..5 are special).
    return [[rng.randrange(6, 384) for _ in range(n)] for n in lengths]


def generate(llm, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                           use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module", params=["llama", "granite", "mistral", "gpt_bigcode", "qwen3",
                                        "mixtral", "bamba", "granitemoehybrid",
                                        "granite_swa", "gpt_oss"])
def arch_llm(request, tiny_models):
    model_dir = tiny_models[request.param]
    with running_llm(model_dir, disable_log_stats=False, **ENGINE_OPTIONS) as llm:
        yield model_dir, llm


def test_single_prompts_match_hf(arch_llm):
    model_dir, llm = arch_llm
    prompts = random_prompts([1, 7, 33], seed=1)
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    for prompt, want in zip(prompts, expected):
        assert generate(llm, [prompt]) == [want]


@pytest.mark.slow
def test_batch_of_16_matches_single_prompts_and_hf(arch_llm):
    model_dir, llm = arch_llm
    lengths = [3, 90, 17, 5, 64, 1, 31, 150, 12, 8, 45, 2, 77, 20, 9, 128]
    prompts = random_prompts(lengths, seed=2)
    batched = generate(llm, prompts)
    singles = [generate(llm, [p])[0] for p in prompts]
    assert batched == singles
    assert batched == hf_greedy(model_dir, prompts, MAX_TOKENS)


@pytest.mark.slow
def test_prompt_longer_than_chunk_size(arch_llm):
    model_dir, llm = arch_llm
    prompts = random_prompts([300], seed=3)  # 3 chunks of at most 128 tokens
    assert generate(llm, prompts) == hf_greedy(model_dir, prompts, MAX_TOKENS)


def _metric(llm, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def _prefix_cache_hits(llm) -> float:
    return _metric(llm, "vllm:prefix_cache_hits")


def _keeps_recurrent_state(llm) -> bool:
    from vllm_accel.architectures import find_architecture

    model_config = llm.llm_engine.model_config
    arch = find_architecture(model_config.architectures)
    return arch.recurrent_dims(model_config.hf_text_config) is not None


@pytest.mark.slow
def test_prefix_cache_hit_gives_same_output(arch_llm):
    model_dir, llm = arch_llm
    shared = random_prompts([200], seed=4)[0]
    first, second = [shared + tail for tail in random_prompts([10, 11], seed=5)]
    generate(llm, [first])
    hits_before = _prefix_cache_hits(llm)
    got = generate(llm, [second])
    if _keeps_recurrent_state(llm):
        # As documented (README): prefix caching is off for a model whose
        # layers keep recurrent state; the second prompt computes in full.
        assert not llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
        assert _prefix_cache_hits(llm) == hits_before == 0
    else:
        # The 6 full 32-token blocks of the shared prefix come from the cache.
        assert _prefix_cache_hits(llm) - hits_before >= 192
    assert got == hf_greedy(model_dir, [second], MAX_TOKENS)


@pytest.mark.slow
def test_requests_arriving_during_decode(arch_llm):
    model_dir, llm = arch_llm
    engine = llm.llm_engine
    prompts = random_prompts([40, 6, 130, 15], seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    arrivals = {0: [0], 3: [1, 2], 7: [3]}  # engine step -> requests added before it
    outputs: dict[str, list[int]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i in arrivals.get(step, []):
            engine.add_request(f"late-{i}", TokensPrompt(prompt_token_ids=prompts[i]), params)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert [outputs[f"late-{i}"] for i in range(4)] == expected


@pytest.mark.slow
def test_preempted_recurrent_requests_restart_from_zero_state(tiny_models, monkeypatch):
    """A KV cache of 16 blocks (64 tokens each, a Mamba2 state per block):
    three requests fill it and grow, so vLLM's scheduler preempts, frees their
    blocks and later computes them again from their first token. Their
    recurrent state must restart from zero there (their new state blocks hold
    other requests' states): greedy output still equals HF's."""
    monkeypatch.setenv("VLLM_ACCEL_KVCACHE_SPACE", "0.001")
    model_dir = tiny_models["bamba"]
    prompts = random_prompts([100, 97, 110, 90, 105, 99], seed=8)
    with running_llm(model_dir, disable_log_stats=False, **ENGINE_OPTIONS) as llm:
        runner = model_runner(llm)
        assert runner.num_blocks <= 16 and runner.kv_cache.state_groups
        got = generate(llm, prompts, max_tokens=48)
        assert _metric(llm, "vllm:num_preemptions") > 0
    assert got == hf_greedy(model_dir, prompts, 48)


def _outputs_with_logprobs(llm, prompts):
    """Every number a user reads back: tokens, sampled logprobs and prompt
    logprobs (greedy and seeded sampling)."""
    params = [SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, prompt_logprobs=2),
              SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=8, logprobs=3)]
    results = []
    for param in params:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], param,
                               use_tqdm=False)
        for o in outputs:
            sampled = [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]
            prompt = [None if step is None else {t: lp.logprob for t, lp in step.items()}
                      for step in (o.prompt_logprobs or [])]
            results.append((list(o.outputs[0].token_ids), sampled, prompt))
    return results


@pytest.mark.slow
def test_two_fresh_engines_give_identical_outputs(tiny_models):
    """The same requests to two fresh engines with the same settings give
    the same tokens and logprobs, bit for bit: how a step is cut into
    forwards follows token counts (the default forward_plan), not warmup's
    timing noise. Prompts cross buckets and the step budget (chunked)."""
    prompts = random_prompts([3, 40, 110, 200, 17], seed=23)
    runs = []
    for _ in range(2):
        with running_llm(tiny_models["llama"], **ENGINE_OPTIONS) as llm:
            runs.append(_outputs_with_logprobs(llm, prompts))
    assert runs[0] == runs[1]


@pytest.mark.slow
def test_kernels_off_runs_onednn_and_torch_and_matches_hf(tiny_models, monkeypatch):
    """cpu_kernels=false: no C++ kernel of ours runs (linear layers by oneDNN,
    attention by torch), and greedy output still equals HF's."""
    from vllm_accel.kernels import NO_KERNELS
    from vllm_accel.model.packed_linear import PackedLinear

    monkeypatch.setenv("VLLM_ACCEL_CPU_KERNELS", "false")
    prompts = random_prompts([5, 40], seed=31)
    with running_llm(tiny_models["llama"], **ENGINE_OPTIONS) as llm:
        runner = model_runner(llm)
        assert runner.kernels == NO_KERNELS
        packed = [m for m in runner.model.modules() if isinstance(m, PackedLinear)]
        assert packed and not any(m.by_kernel for m in packed)
        assert generate(llm, prompts) == hf_greedy(tiny_models["llama"], prompts, MAX_TOKENS)
