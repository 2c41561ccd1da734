"""Tensor parallelism: two workers (vLLM's multiprocessing executor, gloo),
each holding its FMS tensor-parallel shard of the model. Greedy output must
equal one worker's and HF transformers' token for token (float32), through a
batch, chunked prefill and a prefix-cache hit; other parallelisms are refused
naming the setting; a dead worker fails the engine instead of hanging it."""

from __future__ import annotations

import os
import signal
import time

import pytest
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from helpers import hf_greedy, running_llm, tensor_parallel_workers

pytestmark = pytest.mark.slow  # engines and servers: the full suite only

MAX_TOKENS = 12
# Small step budget: the longer prompts prefill in several chunks.
ENGINE_OPTIONS = dict(max_num_batched_tokens=64, max_num_seqs=8, disable_log_stats=False)
# Lengths 90 and 150 exceed the 64-token step budget (chunked prefill).
LENGTHS = [5, 90, 17, 1, 150, 33]


def _prompts(lengths, seed):
    import random

    rng = random.Random(seed)
    return [[rng.randrange(6, 384) for _ in range(n)] for n in lengths]


def generate(llm, prompts, max_tokens=MAX_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                           use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _prefix_cache_hits(llm) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")


# One architecture per kind of layer FMS shards: attention and MLP (Llama;
# Granite's and Mistral's blocks shard alike), multi-query attention with
# learned positions, q/k norm with a head of its own width, experts, and
# windows with sinks and Granite's multipliers.
@pytest.fixture(scope="module", params=["llama", "gpt_bigcode", "qwen3", "mixtral",
                                        "granite_swa"])
def tp_llm(request, tiny_models):
    """A TP=2 engine. The engine core stays in this process (conftest), its two
    workers are processes of vLLM's multiprocessing executor."""
    model_dir = tiny_models[request.param]
    with tensor_parallel_workers():
        started = time.perf_counter()
        # Steps cut by measured forward times: every rank must take the driver's.
        with running_llm(model_dir, tensor_parallel_size=2,
                         additional_config={"accel": {"forward_plan": "measured"}},
                         **ENGINE_OPTIONS) as llm:
            print(f"TP=2 {request.param} engine ready in {time.perf_counter() - started:.1f} s")
            yield request.param, model_dir, llm


def test_tp2_matches_tp1_and_hf_batch_chunked_prefix_cache(tp_llm):
    arch, model_dir, llm = tp_llm
    assert llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend == "mp"
    # Each rank caches its own KV heads: the tiny models' 2 split over 2 ranks.
    specs = llm.collective_rpc("get_kv_cache_spec")
    assert len(specs) == 2
    assert {spec.num_kv_heads for rank in specs for spec in rank.values()} == {1}

    prompts = _prompts(LENGTHS, seed=7)
    got = generate(llm, prompts)  # one batch, long prompts in chunks
    assert got == hf_greedy(model_dir, prompts, MAX_TOKENS)

    # A prefix-cache hit: the shared 96-token prefix (3 blocks) comes from the cache.
    shared = _prompts([96], seed=8)[0]
    first, second = [shared + tail for tail in _prompts([9, 11], seed=9)]
    prefix_outputs = generate(llm, [first])
    hits = _prefix_cache_hits(llm)
    prefix_outputs += generate(llm, [second])
    assert _prefix_cache_hits(llm) - hits >= 96
    assert prefix_outputs == hf_greedy(model_dir, [first, second], MAX_TOKENS)

    # One worker, same engine options: the same tokens, greedy and seeded
    # (random sampling happens once, on the driver; the others take its tokens).
    sampled = seeded_sample(llm)
    with running_llm(model_dir, **ENGINE_OPTIONS) as single:
        assert generate(single, prompts + [first, second]) == got + prefix_outputs
        assert seeded_sample(single) == sampled


def seeded_sample(llm) -> list[list[int]]:
    params = SamplingParams(temperature=1.0, top_k=50, seed=3, max_tokens=MAX_TOKENS)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts([4, 40], seed=10)]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_every_rank_cuts_steps_by_the_drivers_forward_times(tp_llm):
    """Each rank times its own forwards at warmup, but all must cut a step
    into the same forwards (their all-reduces pair up): they take rank 0's."""
    from vllm_accel.buckets import token_count_costs

    _, _, llm = tp_llm
    costs = llm.collective_rpc(_forward_costs)
    assert len(costs) == 2 and costs[0] == costs[1]
    buckets = llm.collective_rpc(_token_buckets)[0]
    assert costs[0] != token_count_costs(buckets)  # measured, not the estimate


def test_killed_worker_fails_the_engine_not_hangs(tp_llm):
    """vLLM's executor watches its workers: when one dies, requests fail with
    an error at once (and a server exits) instead of waiting forever."""
    _, _, llm = tp_llm  # runs last for each engine: it kills a worker
    pids = llm.collective_rpc(_worker_pid)
    os.kill(pids[1], signal.SIGKILL)
    started = time.perf_counter()
    with pytest.raises(Exception) as failure:
        for _ in range(50):  # the monitor notices within moments
            generate(llm, _prompts([8], seed=11), max_tokens=4)
            time.sleep(0.2)
    assert time.perf_counter() - started < 60
    print(f"after the kill: {type(failure.value).__name__}: {failure.value}")


def _worker_pid(worker) -> int:
    return os.getpid()


def _images_encoded(worker) -> int:
    return worker.model_runner.vision_encoder.images_encoded


def test_pipeline_parallel_rejected_naming_the_setting(tiny_models):
    from vllm import LLM

    with pytest.raises(ValueError, match="pipeline_parallel_size=2 .*--tensor-parallel-size"):
        LLM(model=str(tiny_models["llama"]), dtype="float32", max_model_len=512,
            pipeline_parallel_size=2)


def test_recurrent_state_model_refuses_tensor_parallelism_saying_why(tiny_models):
    """FMS's tensor-parallel strategy shards attention and MLPs but not
    Bamba's Mamba2 mixers (they have no TP form): TP>1 fails at start-up."""
    from vllm import LLM

    with pytest.raises(ValueError, match="BambaForCausalLM.*does not shard its Mamba2 layers"
                                         ".*tensor_parallel_size must be 1"):
        LLM(model=str(tiny_models["bamba"]), dtype="float32", max_model_len=512,
            tensor_parallel_size=2)


# `vllm serve --tensor-parallel-size 2` (an answer equal to HF's, then a
# killed worker ends the server): test_tensor_parallel_vision.py's Qwen2.5-VL
# server (a Llama server did the same until 2026-12-04; cut for suite time).


def test_llava_next_tp2_matches_tp1(tmp_path_factory):
    """LlavaNext: FMS shards the Granite text model and keeps the SigLIP vision
    tower whole on each rank; each image is encoded on one rank only."""
    from transformers import AutoProcessor

    from helpers import chat_prompt, noise_image, vision_greedy
    from vllm_accel.testing.fixtures import make_tiny_model

    model_dir = make_tiny_model("llava_next", tmp_path_factory.mktemp("llava") / "llava_next")
    processor = AutoProcessor.from_pretrained(model_dir)
    cases = [(chat_prompt(processor, 1, "What is this?"), [noise_image(64, 48)]),
             (chat_prompt(processor, 0, "Hi"), [])]
    options = dict(max_model_len=2048, limit_mm_per_prompt={"image": 1})
    got = {}
    for tp in (2, 1):
        with tensor_parallel_workers(), running_llm(
                model_dir, tensor_parallel_size=tp, **options) as llm:
            before = llm.collective_rpc(_images_encoded)  # warmup encodes too
            got[tp] = vision_greedy(llm, cases, MAX_TOKENS)
            encoded = [a - b for a, b in zip(llm.collective_rpc(_images_encoded), before)]
            assert sum(encoded) == 1, encoded  # one image, one rank
    assert got[2] == got[1]


def _forward_costs(worker):
    return worker.model_runner.forward_costs


def _token_buckets(worker) -> list[int]:
    return worker.model_runner.token_buckets
