"""vLLM's async scheduling through our runner (worker/in_flight.py), on the cpu
backend where tests run (``async_scheduling=on``; the default turns it on only
on cuda, where it overlaps): each step starts before the previous one's tokens
reach the host, and decode inputs come from the device.

Greedy output against HF transformers, with chunked prefill and with
preemption (requests resumed from the scheduler's copy of their tokens);
seeded sampling with penalties (which read last step's tokens), n > 1,
logprobs and prompt logprobs equal to the same engine without async
scheduling."""

from __future__ import annotations

import os

import pytest
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from vllm_accel.buckets import token_count_costs

from helpers import hf_greedy, model_runner, running_llm, tensor_parallel_workers
from test_generation import random_prompts

pytestmark = pytest.mark.slow  # engines and servers: the full suite only

ENGINE_OPTIONS = dict(max_num_batched_tokens=128, max_num_seqs=16)
LENGTHS = [3, 90, 17, 5, 64, 1, 31, 150, 12, 8, 45, 2, 77, 20, 9, 128]


@pytest.fixture
def async_on(monkeypatch):
    monkeypatch.setenv("VLLM_ACCEL_ASYNC_SCHEDULING", "on")


def scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def greedy(llm, prompts, max_tokens=16):
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens),
                           use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def mixed_traffic(llm) -> dict:
    prompts = [TokensPrompt(prompt_token_ids=p) for p in random_prompts(LENGTHS, seed=4)]
    seeded = llm.generate(prompts, [
        SamplingParams(temperature=1.0, seed=i, max_tokens=12, repetition_penalty=1.3,
                       presence_penalty=0.5, frequency_penalty=0.2)
        for i in range(len(prompts))], use_tqdm=False)
    several = llm.generate(prompts[:4], SamplingParams(temperature=1.0, n=3, seed=3,
                                                       max_tokens=8, logprobs=2),
                           use_tqdm=False)
    prompt_lp = llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=4,
                                                         prompt_logprobs=2), use_tqdm=False)
    return dict(
        seeded=[list(o.outputs[0].token_ids) for o in seeded],
        several=[[list(c.token_ids) for c in o.outputs] for o in several],
        logprobs=[[round(d[t].logprob, 4) for t, d in zip(c.token_ids, c.logprobs)]
                  for o in several for c in o.outputs],
        prompt_logprobs=[[None if d is None else sorted(
            (t, round(x.logprob, 4)) for t, x in d.items()) for d in o.prompt_logprobs]
            for o in prompt_lp],
    )


def test_greedy_batch_with_chunked_prefill_matches_hf(async_on, tiny_models):
    model_dir = tiny_models["llama"]
    prompts = random_prompts(LENGTHS, seed=2)
    with running_llm(model_dir, async_scheduling=True, **ENGINE_OPTIONS) as llm:
        assert isinstance(scheduler(llm), AsyncScheduler)
        got = greedy(llm, prompts)
        runner = model_runner(llm)
        # Decode inputs came from the device, not the host.
        assert runner.tokens_from_device >= sum(len(t) - 1 for t in got)
    assert got == hf_greedy(model_dir, prompts, 16)


def check_preempted_requests_resume(model_dir, **options) -> None:
    """8 requests that grow to 57-122 tokens each in 20 blocks of 16 tokens:
    the scheduler must preempt and resume; greedy output equals HF's."""
    prompts = random_prompts([40, 70, 25, 90, 55, 33, 80, 60], seed=5)
    with running_llm(model_dir, max_model_len=256, num_gpu_blocks_override=20,
                     enable_prefix_caching=False, **ENGINE_OPTIONS, **options) as llm:
        sched = scheduler(llm)
        assert not sched.use_v2_model_runner
        preempted = []
        original = sched._preempt_request

        def counting(request, *args, **kwargs):
            preempted.append(request.request_id)
            return original(request, *args, **kwargs)

        sched._preempt_request = counting
        got = greedy(llm, prompts, max_tokens=32)
    assert preempted, "the KV cache was big enough: nothing was preempted"
    assert got == hf_greedy(model_dir, prompts, 32)


def test_preempted_requests_resume_with_their_tokens(async_on, tiny_models):
    check_preempted_requests_resume(tiny_models["llama"], async_scheduling=True)


@pytest.mark.parametrize("mode", ["off", "on"])
def test_a_host_with_triton_keeps_the_v1_runner_protocol(mode, tiny_models, monkeypatch):
    """Where Triton imports (any CUDA build of torch) vLLM's scheduler would
    talk to the runner as to its V2 model runner, which sends a resumed
    request as a new one without its generated tokens. The platform keeps the
    V1 protocol our runner speaks (found on the H100 host)."""
    import vllm.config.vllm
    from vllm import envs

    monkeypatch.setattr(vllm.config.vllm, "HAS_TRITON", True)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setenv("VLLM_ACCEL_ASYNC_SCHEDULING", mode)
    envs.disable_envs_cache()  # an earlier engine in this process froze vLLM's variables
    check_preempted_requests_resume(tiny_models["llama"])


def test_a_v2_model_runner_is_refused_naming_the_setting(tiny_models, monkeypatch):
    from vllm import envs

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    envs.disable_envs_cache()
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=1: .* V1 model runner"):
        with running_llm(tiny_models["llama"]):
            pass


def test_mixed_traffic_equals_the_engine_without_async_scheduling(tiny_models):
    model_dir = tiny_models["llama"]
    # Both engines cut steps into forwards by the token-count estimate (the
    # default forward_plan): measured timings differ from engine to engine on
    # a busy machine, and float32 matmuls of other row counts differ in the
    # last bits.
    results = {}
    for mode in ("off", "on"):
        os.environ["VLLM_ACCEL_ASYNC_SCHEDULING"] = mode
        try:
            with running_llm(model_dir, **ENGINE_OPTIONS) as llm:
                assert isinstance(scheduler(llm), AsyncScheduler) == (mode == "on")
                runner = model_runner(llm)
                assert runner.forward_costs == token_count_costs(runner.token_buckets)
                results[mode] = mixed_traffic(llm)
        finally:
            del os.environ["VLLM_ACCEL_ASYNC_SCHEDULING"]
    for key in results["off"]:
        assert results["on"][key] == results["off"][key], key


def test_tensor_parallel_workers_take_the_tokens_in_flight(async_on, tiny_models):
    """TP=2 (vLLM's multiprocessing executor): every rank feeds the driver's
    broadcast tokens from its own device, none through the host."""
    model_dir = tiny_models["llama"]
    prompts = random_prompts([5, 90, 17, 1, 150, 33], seed=7)
    with tensor_parallel_workers(), running_llm(
            model_dir, tensor_parallel_size=2, async_scheduling=True,
            max_num_batched_tokens=64, max_num_seqs=8) as llm:
        assert isinstance(scheduler(llm), AsyncScheduler)
        got = greedy(llm, prompts, max_tokens=12)
        taken = llm.collective_rpc("runner_state")
    assert got == hf_greedy(model_dir, prompts, 12)
    assert all(rank["tokens_from_device"] > 0 for rank in taken)
