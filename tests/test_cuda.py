"""The cuda device backend on a real NVIDIA GPU: attention in one Triton launch
equal to the PyTorch path (one_launch_attention.py's cases, which
test_one_launch_interpreted.py runs on the cpu under Triton's interpreter);
greedy output token for token equal to HF transformers' own model classes on
the same GPU (float32), no compiles after warmup under mixed traffic, every
forward replayed from CUDA graphs; and the cpu backend on a host with a CUDA
build of torch.

Skipped without a CUDA device (CI has none); run on the accelerator host."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import chat_prompt, model_runner, noise_image, running_llm, vision_greedy
from one_launch_attention import (model_equals_pytorch_path, one_launch_equals_pytorch_path,
                                  split_kv_equals_one_pass)
from vision_cases import ARCHS as VISION_ARCHS
from vllm_accel.patches import apply_patches
from vllm_accel.architectures import by_model_type
from vllm_accel.testing.fixtures import SUPPORTED_ARCHS, make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (the cuda backend's tests)")

CUDA = {"accel": {"device": "cuda", "compile_backend": "inductor"}}
# Each engine takes a share of the GPU for its KV cache (HF's models take some too).
GPU_SHARE = dict(gpu_memory_utilization=0.3)
MAX_TOKENS = 12
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time, a fox",
           "1, 2, 3, 4,", "Tell me a story about the sea and the stars that shine"]


def greedy(llm, prompts, max_tokens=MAX_TOKENS, **kwargs):
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def hf_cuda_greedy(model_dir, prompts, max_tokens=MAX_TOKENS):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    out = []
    with torch.no_grad():
        for text in prompts:
            ids = tokenizer(text, return_tensors="pt").input_ids.cuda()
            gen = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
            out.append(gen[0, ids.shape[1]:].tolist())
    del model
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("sinks,window", [(False, 0), (True, 0), (True, 24)],
                         ids=["plain", "sinks", "sinks+window"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_launch_attention_equals_the_pytorch_path(dtype, sinks, window):
    one_launch_equals_pytorch_path("cuda", dtype, sinks, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_equals_one_pass(dtype):
    split_kv_equals_one_pass("cuda", dtype)


@pytest.mark.parametrize("arch", [a for a in SUPPORTED_ARCHS
                                  if by_model_type(a).recurrent_state is None])
def test_layers_storing_their_keys_equal_the_pytorch_path(arch, tmp_path):
    model_equals_pytorch_path("cuda", arch, str(tmp_path))


@pytest.fixture(scope="module", params=[a for a in SUPPORTED_ARCHS
                                        if by_model_type(a).recurrent_state is None])
def text_model(request, tmp_path_factory):
    if request.param == "granite_swa":  # transformers has it since after some hosts' versions
        pytest.importorskip("transformers.models.granite_swa")
    return make_tiny_model(request.param, tmp_path_factory.mktemp("cuda") / request.param)


@pytest.mark.parametrize("arch", [a for a in SUPPORTED_ARCHS
                                  if by_model_type(a).recurrent_state is not None])
def test_recurrent_layers_on_cuda_equal_hf(arch, tmp_path):
    """Mamba2 layers (Bamba, Granite 4 hybrid) on the GPU: a batch with
    prompts cut into 16-token chunks (states continued across chunks, then
    decodes) equal to HF's class; forwards of decodes replay CUDA graphs
    (those with a prefill chunk run uncaptured), nothing compiles while
    serving."""
    model = make_tiny_model(arch, tmp_path / arch)
    expected = hf_cuda_greedy(model, PROMPTS)
    config = {"accel": {**CUDA["accel"], "compile_cache_dir": str(tmp_path / "cache")}}
    with running_llm(model, additional_config=config, max_num_seqs=8,
                     max_num_batched_tokens=16, **GPU_SHARE) as llm:
        runner = model_runner(llm)
        assert runner.device.type == "cuda"
        assert all(g.decodes_only for g in runner.graphs.graphs.values())
        assert greedy(llm, PROMPTS) == expected
        assert greedy(llm, PROMPTS[2:3]) == expected[2:3]
        assert runner.graphs.replays > 0
        assert runner.compile_stats.runtime_compiles == 0


def test_text_parity_batch_chunked_and_prefix_hit(text_model, tmp_path):
    expected = hf_cuda_greedy(text_model, PROMPTS)
    config = {"accel": {**CUDA["accel"], "compile_cache_dir": str(tmp_path)}}
    with running_llm(text_model, additional_config=config, max_num_seqs=8,
                     max_num_batched_tokens=16, enable_prefix_caching=True, **GPU_SHARE) as llm:
        runner = model_runner(llm)
        assert runner.device.type == "cuda" and runner.kv_cache.layers[0][0].is_cuda
        assert greedy(llm, PROMPTS) == expected  # a batch, prompts cut into 16-token chunks
        assert greedy(llm, PROMPTS[:1]) == expected[:1]  # a prefix-cache hit
        replays = runner.graphs.replays
        assert greedy(llm, PROMPTS, max_tokens=1) == [t[:1] for t in expected]
        assert runner.graphs.replays > replays  # prefill forwards replay graphs too
        # Async scheduling is on by default on cuda: decode inputs stay on the GPU.
        assert runner.async_scheduling and runner.tokens_from_device > 0
        assert runner.compile_stats.runtime_compiles == 0


def test_a_step_of_several_forwards_replays_each_and_keeps_their_outputs(tmp_path):
    """Steps beyond the largest bucket (16) run as several forwards of one
    bucket: the same graph replays in one step, so each replay's logits (and,
    for prompt logprobs, hidden states) must be kept before the next."""
    from vllm import SamplingParams

    model = make_tiny_model("llama", tmp_path / "llama")
    expected = hf_cuda_greedy(model, PROMPTS)
    config = {"accel": {**CUDA["accel"], "token_buckets": "1,4,16",
                        "compile_cache_dir": str(tmp_path / "cache")}}
    with running_llm(model, additional_config=config, max_num_seqs=8,
                     max_num_batched_tokens=64, **GPU_SHARE) as llm:
        runner = model_runner(llm)
        replays = runner.graphs.replays
        assert greedy(llm, PROMPTS) == expected  # the first step: 64 tokens, 4 forwards
        assert runner.graphs.replays - replays > MAX_TOKENS  # more replays than steps
        with_logprobs = llm.generate(PROMPTS, SamplingParams(
            temperature=0, max_tokens=2, prompt_logprobs=1), use_tqdm=False)
        assert runner.compile_stats.runtime_compiles == 0
    assert [list(o.outputs[0].token_ids) for o in with_logprobs] == [t[:2] for t in expected]
    # Every prompt token's logprob, as HF's model gives it.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).cuda().eval()
    for out in with_logprobs:
        ids = out.prompt_token_ids
        with torch.no_grad():
            reference = hf(torch.tensor([ids], device="cuda")).logits[0].log_softmax(-1)
        got = [out.prompt_logprobs[i][token].logprob for i, token in enumerate(ids) if i]
        want = [reference[i - 1, token].item() for i, token in enumerate(ids) if i]
        assert np.allclose(got, want, atol=1e-3), (got, want)


def test_a_token_bucket_beyond_the_models_rotary_positions_starts(tmp_path):
    """The memory profile runs the largest bucket as one prefill forward: a
    bucket of 4096 tokens on a model of 2048 rotary positions (max_model_len
    512) is eight prompts of 512, not one of 4096 (a device-side assert at
    start-up before)."""
    model = make_tiny_model("llama", tmp_path / "llama")
    config = {"accel": {**CUDA["accel"], "token_buckets": "1,8,4096",
                        "compile_cache_dir": str(tmp_path / "cache")}}
    with running_llm(model, additional_config=config, max_num_seqs=16,
                     max_num_batched_tokens=4096, **GPU_SHARE) as llm:
        assert model_runner(llm).token_buckets == [1, 8, 4096]
        assert greedy(llm, PROMPTS) == hf_cuda_greedy(model, PROMPTS)


def test_mixed_traffic_compiles_nothing_after_warmup(tmp_path):
    from vllm import SamplingParams

    model = make_tiny_model("llama", tmp_path / "llama")
    config = {"accel": {**CUDA["accel"], "compile_cache_dir": str(tmp_path / "cache")}}
    with running_llm(model, additional_config=config, max_num_seqs=8, **GPU_SHARE) as llm:
        runner = model_runner(llm)
        llm.generate(PROMPTS, [
            SamplingParams(temperature=0, max_tokens=8, logprobs=3),
            SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=8),
            SamplingParams(temperature=1.0, top_k=5, n=3, max_tokens=6),
            SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2),
            SamplingParams(temperature=0.7, max_tokens=8, seed=7),
        ], use_tqdm=False)
        assert runner.compile_stats.runtime_compiles == 0
        assert runner.graphs.replays > 0
        # Seeded sampling is reproducible through the graphs.
        seeded = SamplingParams(temperature=0.9, seed=3, max_tokens=8)
        first = llm.generate(PROMPTS[:2], seeded, use_tqdm=False)
        again = llm.generate(PROMPTS[:2], seeded, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]


# Run in a process of its own: Triton keeps compiled variants per process,
# and an earlier test's sampling would have compiled some already.
_COUNT_TRITON_COMPILES = """
import json, sys
from triton import knobs
from vllm import LLM, SamplingParams

model, options, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
llm = LLM(model=model, **options)
compiled, hook = [], knobs.runtime.jit_post_compile_hook

def count(**kwargs):
    compiled.append(getattr(kwargs.get("fn"), "name", "?"))
    return hook(**kwargs) if hook is not None else None

knobs.runtime.jit_post_compile_hook = count  # installed after start-up
for params in (SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4),
               SamplingParams(temperature=0.8, top_k=7, max_tokens=4),
               SamplingParams(temperature=0.8, top_k=7, top_p=0.5, max_tokens=4)):
    for batch in (prompts[:1], prompts[:3]):
        outs = llm.generate(batch, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
print("COMPILED", json.dumps(compiled))
"""


def test_no_triton_kernel_compiles_while_serving(tmp_path):
    """vLLM's sampler JIT-compiles its Triton top-k/top-p kernels per mode
    (top-k, top-p, both), batch 1 apart, and top-p alone per split count;
    start-up compiles them all (``cuda.compile_sampling_kernels``). Counted
    by Triton's own compile hook in a fresh process, engine core in it."""
    import json
    import os
    import subprocess
    import sys

    model = make_tiny_model("llama", tmp_path / "llama")
    options = dict(dtype="float32", max_model_len=512, seed=0, max_num_seqs=8,
                   additional_config=CUDA, **GPU_SHARE)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the hook sees the engine
    run = subprocess.run([sys.executable, "-c", _COUNT_TRITON_COMPILES, str(model),
                          json.dumps(options), json.dumps(PROMPTS)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("COMPILED "))
    assert json.loads(line.removeprefix("COMPILED ")) == []


@pytest.mark.parametrize("rows", [1, 16, 64, 80])
def test_top_k_top_p_masking_on_cuda_equals_vllms_pytorch_path(rows):
    """The masking our sampler runs on cuda (vLLM's Triton kernels, whose
    pivots are searched, not sorted) keeps as many tokens per row as vLLM's
    PyTorch path, within 1 %, in a batch mixing top-k rows with top-p-alone
    rows (top-k off: the vocabulary, as vLLM's input batch sets it); a
    top-p-alone row keeps its whole nucleus (>= p of the probability), not a
    nucleus of its nucleus (~p * p). 80 rows: above the split pipeline's 64."""
    apply_patches()
    from vllm.v1.sample.ops import topk_topp_sampler as sampler

    vocab = 32000
    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = 2 * torch.randn(rows, vocab, device="cuda", generator=gen)
    k = torch.full((rows,), vocab, dtype=torch.int32, device="cuda")
    k[1::2] = 200
    p = torch.full((rows,), 0.9, device="cuda")
    got = sampler.apply_top_k_top_p(logits.clone(), k, p)
    want = sampler.apply_top_k_top_p_pytorch(logits.clone(), k, p)
    kept, kept_want = got.isfinite().sum(1), want.isfinite().sum(1)
    top_p_alone = k == vocab
    mass = (logits.softmax(-1) * got.isfinite()).sum(1)
    assert (mass[top_p_alone] >= 0.9 - 1e-3).all(), mass[top_p_alone].tolist()
    assert ((kept - kept_want).abs() <= 1 + kept_want // 100).all(), \
        list(zip(kept.tolist(), kept_want.tolist()))


_FRESH_PROCESS = """
import json, sys, torch
from vllm import LLM, SamplingParams

model, options, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
llm = LLM(model=model, **options)
front_end_cuda = torch.cuda.is_initialized()
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=int(sys.argv[4])),
                    use_tqdm=False)
print("RESULT", json.dumps({"front_end_cuda": front_end_cuda,
                            "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
"""


def test_a_fresh_process_forks_its_engine_core_and_equals_hf(tmp_path):
    """A user's script (engine core in its own process, vLLM's default): the
    platform's queries in the front-end process go through NVML, so it never
    initializes CUDA and vLLM forks the engine core (a spawned one imports
    vLLM again, ~15 s of each start); the forked engine computes HF's tokens.
    Started again on the same compile cache, every graph and every kernel's
    tuned block sizes come from it: no cache miss, nothing re-tuned. Graphs
    inductor will not cache (its bypasses) are counted apart. (An H100's
    warmups had a third graph without an inductor cache lookup: by the code,
    vLLM's logprob ranking, then compiled at load on the cpu's tensors and
    again in warmup on the GPU's.)"""
    import json
    import os
    import re
    import subprocess
    import sys

    model = make_tiny_model("llama", tmp_path / "llama")
    options = dict(dtype="float32", max_model_len=512, seed=0, max_num_seqs=8,
                   additional_config=CUDA, **GPU_SHARE)
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_WORKER_MULTIPROC_METHOD", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    env["VLLM_ACCEL_COMPILE_CACHE_DIR"] = str(tmp_path / "compile-cache")  # empty: a cold start
    # Empty too: vLLM inspects the model's class, in this process (patch 20).
    env["VLLM_CACHE_ROOT"] = str(tmp_path / "vllm-cache")
    starts = []
    for _ in ("cold", "warm"):
        run = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, str(model),
                              json.dumps(options), json.dumps(PROMPTS), str(MAX_TOKENS)],
                             env=env, capture_output=True, text=True, timeout=600)
        log = run.stdout + run.stderr
        assert run.returncode == 0, log[-3000:]
        assert "We must use the `spawn`" not in log, log[-3000:]
        result = json.loads(next(x for x in run.stdout.splitlines()
                                 if x.startswith("RESULT ")).removeprefix("RESULT "))
        assert result["front_end_cuda"] is False
        line = re.search(r"warmup finished in [\d.]+ s: (\d+) graphs \(compile cache hits "
                         r"(\d+), misses (\d+), bypasses (\d+)\)(?s:.*)warmup [\d.]+ s .*, "
                         r"(\d+) kernel tuning benchmarks", log)
        assert line, log[-3000:]
        starts.append((result["tokens"], *map(int, line.groups())))
    (cold_tokens, graphs, *_, cold_tuning), (warm_tokens, *warm) = starts
    assert cold_tuning > 0  # the counter sees inductor's tuning
    warm_graphs, hits, misses, bypasses, warm_tuning = warm
    assert (warm_graphs, hits + bypasses, misses, warm_tuning) == (graphs, graphs, 0, 0)
    assert cold_tokens == warm_tokens == hf_cuda_greedy(model, PROMPTS)


def test_graphs_off_or_async_scheduling_off_give_the_same_tokens(tmp_path):
    from vllm import SamplingParams

    model = make_tiny_model("granite", tmp_path / "granite")
    # Penalties read the previous step's tokens, which async scheduling keeps
    # on the GPU until the sampler asks.
    penalized = SamplingParams(temperature=0.9, seed=5, max_tokens=10, repetition_penalty=1.3,
                               frequency_penalty=0.3)
    outputs = []
    for graphs, async_scheduling in ((True, "auto"), (False, "auto"), (True, "off")):
        config = {"accel": {**CUDA["accel"], "cuda_graphs": graphs,
                            "async_scheduling": async_scheduling,
                            "compile_cache_dir": str(tmp_path / "cache")}}
        with running_llm(model, additional_config=config, max_num_seqs=8, **GPU_SHARE) as llm:
            sampled = llm.generate(PROMPTS, penalized, use_tqdm=False)
            outputs.append((greedy(llm, PROMPTS), [list(o.outputs[0].token_ids) for o in sampled]))
            runner = model_runner(llm)
            assert (runner.graphs is not None) == graphs
            # One compile cache: the first start compiles the layer graphs,
            # the later ones take every graph from it (saved whole where
            # torch can, else inductor's cache).
            misses = runner.compile_stats.cache_hits[1]
            assert (misses > 0) == (len(outputs) == 1)
            assert runner.async_scheduling == (async_scheduling == "auto")
            # With it, decode inputs stay on the GPU.
            assert (runner.tokens_from_device > 0) == (async_scheduling == "auto")
    assert outputs[0] == outputs[1] == outputs[2]


@pytest.fixture(scope="module", params=VISION_ARCHS, ids=lambda arch: arch.name)
def vision(request, tmp_path_factory):
    """(arch, checkpoint, HF processor, HF model on the GPU)."""
    import transformers
    from transformers import AutoProcessor

    arch = request.param
    path = arch.make(tmp_path_factory.mktemp("cuda") / arch.name)
    if arch.patch_before_processor:
        apply_patches()
    model = getattr(transformers, arch.hf_class).from_pretrained(path, dtype=torch.float32)
    return arch, path, AutoProcessor.from_pretrained(path), model.cuda().eval()


def test_vision_parity_two_images_and_a_chunk_inside_an_image(vision, tmp_path):
    arch, path, processor, hf_model = vision
    cases = [(chat_prompt(processor, 1, f"Describe picture {i}."), [noise_image(*size)])
             for i, size in enumerate(arch.sizes)]
    cases.append((chat_prompt(processor, 2, "Compare them."),
                  [noise_image(*size) for size in arch.two_images]))
    expected = []
    with torch.no_grad():
        for prompt, images in cases:
            inputs = processor(text=prompt, images=images, return_tensors="pt").to("cuda")
            out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
            expected.append(out[0, inputs.input_ids.shape[1]:].tolist())
    config = {"accel": {**CUDA["accel"], "compile_cache_dir": str(tmp_path)}}
    with running_llm(path, additional_config=config, max_num_batched_tokens=arch.chunk_tokens,
                     **arch.engine, **GPU_SHARE) as llm:
        runner = model_runner(llm)
        assert next(runner.vision.fms_model.parameters()).is_cuda
        assert vision_greedy(llm, cases, MAX_TOKENS) == expected
        assert runner.compile_stats.runtime_compiles == 0


@pytest.mark.parametrize("arch", ["molmo", "molmoe"])
def test_molmo_on_cuda_equals_the_cpu_backend(arch, tmp_path):
    """Molmo is not in transformers: the cpu backend's output (checked against
    vLLM's own Molmo in test_molmo.py, MolmoE's against OLMoE's decoder in
    test_molmoe.py) is the reference here."""
    import os

    os.environ["HF_HOME"] = str(tmp_path / "hf")  # remote code copies land here
    path = make_tiny_model(arch, tmp_path / arch)
    prompts = [{"prompt": "User: Describe this. Assistant:",
                "multi_modal_data": {"image": [noise_image(112, 80)]}},
               {"prompt": "User: Tell me a story. Assistant:"}]
    outputs = []
    for device in ("cpu", "cuda"):
        config = {"accel": {"device": device, "compile_backend": "eager"}}
        with running_llm(path, additional_config=config, trust_remote_code=True,
                         max_model_len=2048, limit_mm_per_prompt={"image": 1},
                         **GPU_SHARE) as llm:
            outputs.append(greedy(llm, prompts))
    assert outputs[0] == outputs[1]


def test_cpu_backend_on_a_cuda_host(tmp_path):
    """vLLM asks num_compute_units and takes its Triton top-k/top-p for host
    tensors when Triton is importable: the cpu device must still serve."""
    from vllm import SamplingParams

    model = make_tiny_model("llama", tmp_path / "llama")
    config = {"accel": {"device": "cpu", "compile_backend": "eager"}}
    with running_llm(model, additional_config=config) as llm:
        assert model_runner(llm).device.type == "cpu"
        out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.8, top_k=5, top_p=0.9,
                                                       seed=0, max_tokens=6), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in out)


@pytest.mark.parametrize("kind", ["bert", "qwen3_embedder"])
def test_embeddings_on_cuda_equal_hf(kind, tmp_path):
    """An encoder (no KV cache; prompts of 3-106 tokens packed in blocks of
    256, a step's first forward holding two: a mask a block) and a decoder
    embedder (paged attention, CUDA graphs), a batch of mixed lengths."""
    from test_pooling import TEXTS, TOL, embed, hf_embedding, token_ids
    from vllm_accel.testing.tiny_encoders import make_tiny_encoder

    model_dir = make_tiny_encoder(kind, tmp_path / kind)
    max_model_len = 128 if kind == "bert" else 512
    with running_llm(model_dir, additional_config=CUDA, runner="pooling",
                     max_model_len=max_model_len, max_num_seqs=8, **GPU_SHARE) as llm:
        runner = model_runner(llm)
        prompts = token_ids(llm, TEXTS) * (3 if kind == "bert" else 1)
        got = embed(llm, prompts) + embed(llm, prompts[:1])
        assert runner.compile_stats.runtime_compiles == 0
    for p, vector in zip(prompts + prompts[:1], got):
        expected = hf_embedding(model_dir, kind, p)
        assert torch.allclose(vector, expected, atol=TOL, rtol=0), (vector - expected).abs().max()
