"""Tensor parallelism for the vision families with our FMS ports (Qwen2.5-VL;
Molmo with the 7B-D and 7B-O decoders; MolmoE, whose experts FMS's strategy
shards by their inner width) and FMS's own Mistral3, sharded by FMS's own
TensorParallelStrategy over two gloo ranks.

Model level: each rank loads its shard with ``load_fms_model(tp_group=...)``;
the sharded decoder's logits equal the whole decoder's. Engine level (two
workers of vLLM's executor): greedy tokens equal HF transformers'
(Qwen2.5-VL, Mistral3), vLLM's own Molmo's (as test_molmo.py) or MolmoE's
oracle (as test_molmoe.py) for one image, two
images, a prefill chunk ending inside an image, text only, all as one batch;
each image is encoded on one rank only (counters summed over the ranks)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from molmo_reference import (
    _free_port,
    build_vllm_molmo,
    image,
    isolate_remote_code_cache,
    reference_greedy,
    vllm_config,
    vllm_processor,
)
from molmoe_reference import olmoe_decoder, vision_backbone
from vision_cases import MISTRAL3, QWEN2_5_VL, QWEN3_VL, cases, expected, hf, model_dir  # noqa: F401 (fixtures)

from helpers import chat_prompt, noise_image, running_llm, tensor_parallel_workers, vision_greedy
from vllm_accel.testing.fixtures import make_tiny_model
from vllm_accel.testing.tiny_molmo import EMBEDDING_SIZE, make_tiny_molmo
from vllm_accel.testing.tiny_molmoe import TextWidths, make_tiny_molmoe

pytestmark = pytest.mark.slow  # engines and servers: the full suite only

TP = 2
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    isolate_remote_code_cache(tmp_path_factory.getbasetemp() / "hf_modules")
    root = tmp_path_factory.mktemp("tp-vision")
    return {
        "qwen2_5_vl": make_tiny_model("qwen2_5_vl", root / "qwen2_5_vl"),
        "molmo_7b_d": make_tiny_molmo(root / "molmo_d", decoder="qwen2"),
        "molmo_7b_o": make_tiny_molmo(root / "molmo_o", decoder="olmo"),
        "molmoe": make_tiny_molmoe(root / "molmoe"),
    }


# ---- model level --------------------------------------------------------------


def _decoder_logits(path: str, embeds: torch.Tensor, tp_group=None):
    """(logits of the decoder fed ``embeds``, this rank's KV heads, MLP
    width: an expert's with experts)."""
    from transformers import AutoConfig

    from vllm_accel.model.fms_causal_lm import load_fms_model

    hf_config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    model = load_fms_model(path, hf_config, torch.float32, trust_remote_code=True,
                           tp_group=tp_group)
    decoder = model.language_model
    layer = decoder.base_model.layers[0]
    with torch.no_grad():
        logits = decoder(embeds)
    ff = layer.ff_sub_layer
    width = ff.cond_ffn.intermediate_size if hasattr(ff, "cond_ffn") else ff.hidden_dim
    return logits, layer.attn.kvheads, width


def _rank_main(rank: int, port: int, path: str, embeds: torch.Tensor, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=TP)
    try:
        logits, kv_heads, mlp = _decoder_logits(path, embeds, dist.group.WORLD)
        # numpy: pickled by value (a tensor would travel as a shared-memory
        # handle that dies with this process).
        results.put((rank, (logits.numpy(), kv_heads, mlp)))
        # Both ranks done talking before either tears its group down: a rank
        # that left first once aborted the other's gloo thread at exit (SIGABRT).
        dist.barrier()
    finally:
        dist.destroy_process_group()


# Qwen2.5-VL's sharded decoder is checked through the engine (test_tp2_matches_hf).
@pytest.mark.parametrize("name", ["molmo_7b_d", "molmo_7b_o", "molmoe"])
def test_sharded_decoder_equals_whole(checkpoints, name):
    path = str(checkpoints[name])
    torch.manual_seed(0)
    hidden = 256  # the fixtures' decoder width
    embeds = torch.randn(1, 40, hidden) * 0.5
    want, kv_heads, mlp = _decoder_logits(path, embeds)

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, path, embeds, results))
             for r in range(TP)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank in range(TP):
        logits, rank_kv_heads, rank_mlp = got[rank]
        # Heads and MLP rows split; the LM head whole (every rank has all logits).
        assert rank_kv_heads == kv_heads // TP
        assert rank_mlp == mlp // TP
        torch.testing.assert_close(torch.from_numpy(logits), want, atol=2e-5, rtol=0)


# ---- engine level ---------------------------------------------------------------

ENGINE = dict(max_model_len=1024, limit_mm_per_prompt={"image": 2}, max_num_seqs=8,
              tensor_parallel_size=TP)


@contextlib.contextmanager
def tp_engine(path, **options):
    """A TP=2 engine: the engine core in this process, two worker processes."""
    with tensor_parallel_workers(), running_llm(path, **ENGINE, **options) as llm:
        yield llm


def _images_encoded(worker) -> int:
    return worker.model_runner.vision_encoder.images_encoded


def _worker_pid(worker) -> int:
    return os.getpid()


def assert_each_image_encoded_once(llm, send_two_fresh_images) -> None:
    """Two new images in one prompt: each encoded once, by one rank each."""
    before = llm.collective_rpc(_images_encoded)
    send_two_fresh_images()
    after = llm.collective_rpc(_images_encoded)
    assert [a - b for a, b in zip(after, before)] == [1] * TP


def assert_killed_worker_fails_the_engine(llm, send_request) -> None:
    os.kill(llm.collective_rpc(_worker_pid)[1], signal.SIGKILL)
    started = time.perf_counter()
    with pytest.raises(Exception):
        for _ in range(50):  # vLLM's executor notices within moments
            send_request()
            time.sleep(0.2)
    assert time.perf_counter() - started < 60


@pytest.fixture(scope="module", params=[QWEN2_5_VL, MISTRAL3, QWEN3_VL],
                ids=lambda arch: arch.name)
def arch(request):
    return request.param


def test_tp2_matches_hf(arch, model_dir, hf, cases, expected):  # noqa: F811
    """Qwen2.5-VL and Qwen3-VL (our ports; Qwen3-VL's per-head q/k norms and
    DeepStack rows) and Mistral3 (FMS's Mistral; the Pixtral tower whole on
    each rank): one image at each size, two images, text only: one
    batch, in prefill chunks that end inside images; then two fresh images,
    each encoded by one rank; then (Qwen2.5-VL) a killed worker fails the
    engine."""
    processor, _ = hf
    with tp_engine(model_dir, max_num_batched_tokens=arch.chunk_tokens) as llm:
        assert {spec.num_kv_heads for rank in llm.collective_rpc("get_kv_cache_spec")
                for spec in rank.values()} == {1}  # 2 KV heads over 2 ranks
        assert vision_greedy(llm, cases, MAX_TOKENS) == expected

        fresh = [(chat_prompt(processor, 2, "Compare them."),
                  [noise_image(*size, seed=101 + i) for i, size in enumerate(arch.two_images)])]
        assert_each_image_encoded_once(llm, lambda: vision_greedy(llm, fresh, 2))
        if arch is QWEN2_5_VL:  # once is enough: the executor's, not the model's
            assert_killed_worker_fails_the_engine(llm, lambda: vision_greedy(llm, fresh, 2))


def molmo_prompt(question: str) -> str:
    return f"User: {question} Assistant:"  # the fixture's chat template


MOLMO_CASES = [
    (molmo_prompt("Describe picture 0."), [image(112, 80, 0)]),
    (molmo_prompt("Describe picture 1."), [image(80, 40, 1)]),
    (molmo_prompt("Compare them."), [image(112, 80, 11), image(40, 80, 12)]),
    (molmo_prompt("Tell me a story about a fox."), []),
]


def molmo_greedy(llm, cases, max_tokens=MAX_TOKENS):
    """(prompt ids, token ids) per case, one batch."""
    from vllm import SamplingParams

    requests = [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else {"prompt": p}
                for p, imgs in cases]
    outs = llm.generate(requests, SamplingParams(temperature=0, max_tokens=max_tokens),
                        use_tqdm=False)
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]


@pytest.fixture(scope="module")
def molmo_expected(checkpoints):
    """vLLM's own Molmo on each case, per decoder; computed before any engine
    runs (building it sets up vLLM's one-process distributed state)."""
    expected = {}
    for name in ("molmo_7b_o",):
        model, config, _ = build_vllm_molmo(checkpoints[name])
        processor, tokenizer = vllm_processor(config)
        expected[name] = [reference_greedy((model, processor, tokenizer), p, imgs, MAX_TOKENS)[:2]
                          for p, imgs in MOLMO_CASES]
    return expected


@pytest.mark.parametrize("name", ["molmo_7b_o"])
def test_molmo_tp2_matches_vllm_molmo(checkpoints, molmo_expected, name):
    """7B-O ("num_key_value_heads": null, q/k norm over the split heads; both
    decoders' shards are checked whole in test_sharded_decoder_equals_whole):
    one batch in 32-token chunks ending inside images; two fresh images
    encoded by one rank each."""
    with tp_engine(checkpoints[name], max_num_batched_tokens=32,
                   trust_remote_code=True) as llm:
        got = molmo_greedy(llm, MOLMO_CASES)
        assert got == [tuple(want) for want in molmo_expected[name]]
        fresh = [(molmo_prompt("Compare them."), [image(80, 80, 101), image(112, 40, 102)])]
        assert_each_image_encoded_once(llm, lambda: molmo_greedy(llm, fresh, 2))


@pytest.fixture(scope="module")
def molmoe_expected(checkpoints):
    """MolmoE's oracle (molmoe_reference.py) on each case."""
    from molmoe_reference import reference_greedy as molmoe_reference_greedy

    path = checkpoints["molmoe"]
    processor, tokenizer = vllm_processor(vllm_config(path))
    reference = (olmoe_decoder(path), vision_backbone(path), processor, tokenizer, EMBEDDING_SIZE)
    return [tuple(molmoe_reference_greedy(reference, p, imgs, MAX_TOKENS)) for p, imgs in MOLMO_CASES]


def test_molmoe_tp2_matches_its_oracle(checkpoints, molmoe_expected):
    """MolmoE: heads and each expert's inner width split over the ranks (the
    router whole on each), experts as the engine runs them: one batch in
    32-token chunks ending inside images equals the oracle; two fresh images
    encoded by one rank each."""
    with tp_engine(checkpoints["molmoe"], max_num_batched_tokens=32,
                   trust_remote_code=True) as llm:
        assert llm.collective_rpc(_expert_widths) == [TextWidths().expert_width // TP] * TP
        assert molmo_greedy(llm, MOLMO_CASES) == molmoe_expected
        fresh = [(molmo_prompt("Compare them."), [image(80, 80, 103), image(112, 40, 104)])]
        assert_each_image_encoded_once(llm, lambda: molmo_greedy(llm, fresh, 2))


def _expert_widths(worker) -> int:
    return worker.model_runner.model.fms_model.base_model.layers[0].ff_sub_layer.intermediate


def _served_image(url: str):
    import base64
    import io

    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


# Qwen2.5-VL's server only (Molmo-7B-O's ran too until 2026-12-04, cut to keep
# the suite under 15 minutes; its TP engine is tested above).
@pytest.mark.parametrize("name", ["qwen2_5_vl"])
def test_serve_tp2_image_chat_then_exits_when_a_worker_dies(checkpoints, name, tmp_path):
    """`vllm serve --tensor-parallel-size 2` as users run it: an image chat
    answered with the reference's tokens (HF's Qwen2.5-VL; vLLM's own Molmo),
    then a killed worker ends the server, its log naming the dead worker."""
    import re
    import subprocess

    import openai

    from helpers import kill_a_worker_and_wait_for_exit, wait_until_serving
    from test_serve import VLLM, free_port, server_env
    from test_serve_vision import FAST, GOOD_URL, QUESTION, ask, image_part, text, user

    model = str(checkpoints[name])
    port, log = free_port(), tmp_path / "server.log"
    cmd = [VLLM, "serve", model, "--host", "127.0.0.1", "--port", str(port), "--dtype",
           "float32", "--max-model-len", "1024", "--tensor-parallel-size", str(TP),
           "--trust-remote-code"]
    env = server_env(**FAST, HF_HOME=str(tmp_path / "hf"))
    env.pop("VLLM_WORKER_MULTIPROC_METHOD", None)  # the platform's own choice
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, base, log)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        reply = ask(client, model, user(image_part(GOOD_URL), text(QUESTION)),
                    extra_body={"return_token_ids": True})
        want_prompt, want_tokens = _reference_chat(name, model, _served_image(GOOD_URL),
                                                   QUESTION, max_tokens=8)
        assert reply.prompt_token_ids == want_prompt
        assert reply.choices[0].token_ids == want_tokens

        log_text = kill_a_worker_and_wait_for_exit(proc, log, TP)
        assert re.search(r"Worker proc VllmWorker-\d died unexpectedly", log_text), log_text[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def _reference_chat(name, model, picture, question, max_tokens):
    """(prompt ids, greedy ids) of a one-image chat from the reference."""
    if name == "molmo_7b_o":
        model_obj, config, _ = build_vllm_molmo(Path(model))
        processor, tokenizer = vllm_processor(config)
        prompt_ids, tokens, *_ = reference_greedy((model_obj, processor, tokenizer),
                                                  molmo_prompt(question), [picture], max_tokens)
        return prompt_ids, tokens
    import transformers

    from vllm_accel.patches import apply_patches

    apply_patches()
    processor = transformers.AutoProcessor.from_pretrained(model)
    hf_model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model, dtype=torch.float32).eval()
    inputs = processor(text=chat_prompt(processor, 1, question), images=picture,
                       return_tensors="pt")
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return inputs.input_ids[0].tolist(), out[0, inputs.input_ids.shape[1]:].tolist()


def test_tp_size_that_cannot_split_the_kv_heads_fails_naming_the_sizes(checkpoints):
    """4 attention heads and (overridden) 3 KV heads: 2 ranks cannot share the
    KV heads evenly nor replicate them; only 1 works. (A size that does not
    divide the attention heads vLLM itself refuses.)"""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(checkpoints["molmo_7b_o"]), trust_remote_code=True,
                      dtype="float32", max_model_len=512, tensor_parallel_size=2,
                      hf_overrides={"num_key_value_heads": 3})
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 \(--tensor-parallel-size\) "
                       r"cannot split .*4 attention heads and 3 KV heads evenly: use one of \[1\]"):
        args.create_engine_config()
