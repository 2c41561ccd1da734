"""Pooling models (embedders, classifiers, a cross-encoder) against HF
transformers' own classes, float32, within 1e-4; batches of mixed lengths
equal to one prompt at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from vllm import PoolingParams, TokensPrompt
from vllm.exceptions import VLLMValidationError

from helpers import model_runner, running_llm
from vllm_accel.testing.tiny_encoders import make_tiny_encoder

TOL = 1e-4
# Lengths across token buckets (1, 8, 16, 32, ...), one past 64.
TEXTS = ["a", "hello world", "The quick brown fox jumps over the lazy dog.",
         "Once upon a time there was a little robot who lived in a quiet town near the sea. "
         "Every morning the robot walked to the harbour, counted the boats, and wrote the "
         "numbers in a notebook: one, two, three, four, five."]
ENGINE = dict(max_model_len=512, max_num_seqs=8)


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    return lambda kind: make_tiny_encoder(kind, root / kind)


def hf_hidden(model_dir, kind: str, ids: list[int]) -> torch.Tensor:
    """HF's last hidden states [tokens, hidden] for one prompt."""
    from transformers import AutoModel, BertModel, MPNetModel, RobertaModel

    inputs = {"input_ids": torch.tensor([ids])}
    if kind == "qwen3_embedder":
        model = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    else:
        model = {"bert": BertModel, "roberta": RobertaModel, "mpnet": MPNetModel}[kind]
        model = model.from_pretrained(model_dir, add_pooling_layer=False)
    if kind == "mpnet":
        # HF's MPNet numbers every token but id 1 (its fixed padding index) from
        # 2; the fixture's tokenizer has <eos> there, a real MPNet one <pad>.
        inputs["position_ids"] = torch.arange(2, len(ids) + 2)[None]
    with torch.no_grad():
        return model.eval()(**inputs).last_hidden_state[0]


def hf_embedding(model_dir, kind: str, ids: list[int]) -> torch.Tensor:
    """The fixture's sentence-transformers pooling, on HF's hidden states."""
    hidden = hf_hidden(model_dir, kind, ids)
    pooled = {"bert": hidden.mean(0), "roberta": hidden[0], "qwen3_embedder": hidden[-1],
              "mpnet": hidden.mean(0)}[kind]
    return pooled if kind == "roberta" else F.normalize(pooled, dim=0)


def token_ids(llm, texts):
    return [llm.get_tokenizer()(t).input_ids for t in texts]


def embed(llm, prompts, **params):
    outs = llm.embed([TokensPrompt(prompt_token_ids=p) for p in prompts], use_tqdm=False,
                     pooling_params=PoolingParams(**params) if params else None)
    return [torch.tensor(o.outputs.embedding) for o in outs]


@pytest.mark.parametrize("kind", ["bert", "roberta", "mpnet"])
def test_encoder_embeddings_equal_hf_in_a_batch_and_one_at_a_time(kind, encoders):
    model_dir = encoders(kind)
    with running_llm(model_dir, **ENGINE) as llm:
        prompts = token_ids(llm, TEXTS)
        batched = embed(llm, prompts)
        alone = [embed(llm, [p])[0] for p in prompts]
        assert model_runner(llm).kv_cache.nbytes() == 0  # no KV cache
    for p, got, single in zip(prompts, batched, alone):
        expected = hf_embedding(model_dir, kind, p)
        assert torch.allclose(got, expected, atol=TOL, rtol=0), (got - expected).abs().max()
        assert torch.allclose(got, single, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_decoder_embedder_equals_hf_through_chunks_and_a_prefix_hit(encoders):
    """Qwen3 as an embedder (last token, normalized): a prompt longer than
    a step's token budget pools once its last chunk ran; the same prompt
    again hits the prefix cache and pools alike."""
    model_dir = encoders("qwen3_embedder")
    with running_llm(model_dir, runner="pooling", max_num_batched_tokens=32,
                     enable_prefix_caching=True, **ENGINE) as llm:
        prompts = token_ids(llm, TEXTS)
        assert len(prompts[-1]) > 32  # chunked
        batched = embed(llm, prompts)
        again = embed(llm, [prompts[-1]])[0]
    for p, got in zip(prompts, batched):
        expected = hf_embedding(model_dir, "qwen3_embedder", p)
        assert torch.allclose(got, expected, atol=TOL, rtol=0), (got - expected).abs().max()
    assert torch.allclose(again, batched[-1], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_classifier_probabilities_and_cross_encoder_scores_equal_hf(encoders):
    from transformers import AutoTokenizer, BertForSequenceClassification

    classifier_dir, cross_dir = encoders("bert_classifier"), encoders("cross_encoder")
    with running_llm(classifier_dir, **ENGINE) as llm:
        prompts = token_ids(llm, TEXTS)
        probs = [torch.tensor(o.outputs.probs) for o in
                 llm.classify([TokensPrompt(prompt_token_ids=p) for p in prompts],
                              use_tqdm=False)]
    hf = BertForSequenceClassification.from_pretrained(classifier_dir).eval()
    for p, got in zip(prompts, probs):
        with torch.no_grad():
            expected = hf(torch.tensor([p])).logits[0].softmax(-1)
        assert torch.allclose(got, expected, atol=TOL, rtol=0), (got, expected)

    query, docs = "What is the capital of France?", TEXTS[1:]
    with running_llm(cross_dir, **ENGINE) as llm:
        scores = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    tokenizer = AutoTokenizer.from_pretrained(cross_dir)
    hf = BertForSequenceClassification.from_pretrained(cross_dir).eval()
    for doc, got in zip(docs, scores):
        pair = tokenizer(query, doc, return_tensors="pt")
        assert pair.token_type_ids.any()  # the second text's tokens are of type 1
        with torch.no_grad():
            expected = hf(**pair).logits[0, 0].sigmoid().item()
        assert abs(got - expected) < TOL, (got, expected)


@pytest.mark.slow
def test_pooler_config_override_and_matryoshka_dimensions(encoders):
    """--pooler-config replaces the checkpoint's pooling (CLS for its mean);
    a request's dimensions keep the embedding's first ones, normalized."""
    from vllm.config import PoolerConfig

    model_dir = encoders("bert")
    with running_llm(model_dir, pooler_config=PoolerConfig(seq_pooling_type="CLS"),
                     **ENGINE) as llm:
        prompts = token_ids(llm, TEXTS[1:3])
        full = embed(llm, prompts)
        short = embed(llm, prompts, dimensions=16)
        with pytest.raises(VLLMValidationError, match=r"dimensions \[16, 32, 64\], got 20"):
            embed(llm, prompts, dimensions=20)  # not one of the model's
    for p, got, got_short in zip(prompts, full, short):
        cls = hf_hidden(model_dir, "bert", p)[0]
        assert torch.allclose(got, F.normalize(cls, dim=0), atol=TOL, rtol=0)
        assert torch.allclose(got_short, F.normalize(cls[:16], dim=0), atol=TOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bert", "mpnet"])  # span attention; a float mask per bucket
def test_compiled_encoder_serves_mixed_lengths_without_compiling(kind, encoders, tmp_path):
    """Inductor graphs per token bucket at warmup, none while serving; a step
    longer than the largest bucket runs as forwards of whole prompts."""
    model_dir = encoders(kind)
    settings = {"compile_backend": "inductor", "token_buckets": "1,4,16,32",
                "compile_cache_dir": str(tmp_path)}
    with running_llm(model_dir, additional_config={"accel": settings}, max_model_len=32,
                     max_num_batched_tokens=128, max_num_seqs=8) as llm:
        runner = model_runner(llm)
        prompts = token_ids(llm, TEXTS[:3] + [TEXTS[3][:60]])
        assert sum(map(len, prompts)) > 32
        got = embed(llm, prompts) + embed(llm, prompts[:1])
        assert runner.compile_stats.runtime_compiles == 0
    for p, vector in zip(prompts + prompts[:1], got):
        expected = hf_embedding(model_dir, kind, p)
        assert torch.allclose(vector, expected, atol=TOL, rtol=0)


def test_an_encoder_needs_a_token_bucket_that_holds_its_longest_prompt(encoders):
    with pytest.raises(Exception, match=r"largest token bucket must be at least "
                                        r"max_model_len=32"):
        with running_llm(encoders("bert"), additional_config={"accel": {"token_buckets": "1,16"}},
                         max_model_len=32):
            pass


def test_an_encoder_on_a_gpu_runs_a_whole_step_in_blocks_of_whole_prompts():
    from vllm_accel.worker.pooling import (blocks_per_forward, encoder_block,
                                           encoder_token_buckets)

    assert encoder_token_buckets("", 4096, 512, large_forwards=False)[-1] == 512
    gpu = encoder_token_buckets("", 4096, 512, large_forwards=True)
    assert gpu[-4:] == [512, 1024, 2048, 4096] and encoder_block(gpu, 512, True) == 512
    gpu = encoder_token_buckets("", 4096, 300, large_forwards=True)
    assert gpu[-4:] == [384, 768, 1536, 3072] and encoder_block(gpu, 300, True) == 384
    assert encoder_block([1, 64, 1024], 512, large_forwards=False) == 1024  # the cpu's
    assert blocks_per_forward(7, [1, 2, 4, 8]) == [4, 2, 1]
    assert blocks_per_forward(19, [1, 2, 4, 8]) == [8, 8, 2, 1]
    assert blocks_per_forward(7, [1, 3]) == [3, 3, 1]  # a bucket spec's
    assert encoder_token_buckets("1,64,1024", 4096, 512, large_forwards=True)[-1] == 1024
    with pytest.raises(ValueError, match="VLLM_ACCEL_TOKEN_BUCKETS='1,64'"):
        encoder_token_buckets("1,64", 4096, 512, large_forwards=True)


def test_encoder_steps_cut_into_full_forwards_of_whole_prompts():
    import numpy as np

    from vllm_accel.worker.pooling import encoder_blocks

    counts = np.array([10, 20, 5, 32, 1])
    cut = [f.tolist() for f in encoder_blocks(counts, 32)]
    assert cut == [[3], [1, 0, 4], [2]]  # longest first, each into the first forward it fits
    assert [f.tolist() for f in encoder_blocks(counts, 1000)] == [[3, 1, 0, 2, 4]]
    rng = np.random.default_rng(0)
    counts = rng.integers(8, 257, 128)
    cut = encoder_blocks(counts, 512)
    assert sorted(np.concatenate(cut).tolist()) == list(range(128))
    assert all(counts[f].sum() <= 512 for f in cut)
    assert len(cut) <= -(-counts.sum() // 512) + 1  # all but one forward nearly full


@pytest.mark.parametrize("kind", ["bert", "roberta", "mpnet"])
def test_a_packed_forward_by_one_mask_a_block_equals_attention_by_spans(kind, encoders):
    """A GPU keeps a packed forward's prompts apart by one mask a block of
    whole prompts (``FmsEncoder.masked_attention``; MPNet: its position bias
    a block), the cpu by their spans: the same states, in one block or in
    three (HF's class, one prompt at a time, for the block forward)."""
    import numpy as np
    from transformers import AutoConfig

    from vllm_accel.kernels.span_attention import span_mask
    from vllm_accel.model.fms_encoder import load_fms_encoder
    from vllm_accel.worker.pooling import EncoderStep, pack_encoder_step

    model_dir = encoders(kind)
    encoder = load_fms_encoder(str(model_dir), AutoConfig.from_pretrained(model_dir), kind,
                               torch.float32)
    ids = np.arange(4, 4 + 4 * 20).reshape(4, 20)
    step = pack_encoder_step(ids[:2], np.array([20, 7]), [None, None], lambda n: 32)
    inputs = (step.input_ids, step.positions, step.token_types, step.ranges)
    assert span_mask(step.ranges, 32)[0, 0].sum(-1).tolist() == [20] * 20 + [7] * 7 + [1] * 5
    # Blocks of 32: [20, 7], [20], [13, 9]; the second block is mostly padding.
    lengths = [[20, 7], [20], [13, 9]]
    blocks = EncoderStep.of_blocks([
        pack_encoder_step(ids[:len(n)], np.array(n), [None] * len(n), lambda n: 32)
        for n in lengths])
    assert blocks.ranges.shape == (3, 32, 2) and blocks.input_ids.shape == (1, 96)
    assert blocks.live.tolist() == [*range(27), *range(32, 52), *range(64, 86)]
    block_inputs = (blocks.input_ids, blocks.positions, blocks.token_types, blocks.ranges)
    with torch.no_grad():
        by_spans = encoder(*inputs)[0, :len(step.live)]
        if kind != "mpnet":  # MPNet attends by its position bias everywhere
            encoder.attention = encoder.masked_attention  # what a GPU's ranges choose
        by_mask = encoder(*inputs)[0, :len(step.live)]
        by_blocks = encoder(*block_inputs)[0, torch.from_numpy(blocks.live)]
    assert torch.allclose(by_mask, by_spans, atol=1e-5, rtol=0)
    prompts = [ids[row, :count].tolist() for n in lengths for row, count in enumerate(n)]
    want = torch.cat([hf_hidden(model_dir, kind, p) for p in prompts])
    assert torch.allclose(by_blocks, want, atol=1e-4, rtol=0)


def test_a_step_in_forwards_of_blocks_gives_each_prompt_hfs_states(encoders):
    """``encode_step`` as a GPU runs it (buckets past the longest prompt's
    hold 2, 4, ... blocks of whole prompts), here on the cpu: 9 prompts
    in 6 blocks of 32 tokens, forwards of 4 and 2 blocks, each prompt's
    states HF's, in batch order."""
    from types import SimpleNamespace

    import numpy as np
    from transformers import AutoConfig

    from vllm_accel.forward_context import ForwardContext
    from vllm_accel.model.fms_encoder import load_fms_encoder
    from vllm_accel.worker.pooling import encode_step, encoder_token_buckets

    model_dir = encoders("bert")
    encoder = load_fms_encoder(str(model_dir), AutoConfig.from_pretrained(model_dir), "bert",
                               torch.float32)
    counts = np.array([30, 5, 17, 12, 28, 9, 31, 20, 25])
    ids = np.random.default_rng(0).integers(4, 90, (len(counts), 32))
    forwards = []
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(token_ids_cpu=ids,
                                    get_pooling_params=lambda: [PoolingParams()] * len(counts)),
        token_buckets=encoder_token_buckets("", 128, 32, large_forwards=True),
        max_model_len=32, device="cpu", encoder=encoder, forward_context=ForwardContext,
        backend=SimpleNamespace(prefers_large_forwards=True),
        compile_stats=SimpleNamespace(after_step=forwards.append))
    assert runner.token_buckets[-3:] == [32, 64, 128]
    with torch.no_grad():
        hidden = encode_step(runner, counts)
    assert forwards == ["a forward of 128 tokens", "a forward of 64 tokens"]
    want = torch.cat([hf_hidden(model_dir, "bert", ids[row, :n].tolist())
                      for row, n in enumerate(counts)])
    assert torch.allclose(hidden, want, atol=1e-4, rtol=0)


def test_an_engine_with_a_gpus_blocks_compiles_nothing_after_warmup(encoders, monkeypatch):
    """The engine as a GPU runs an encoder (buckets past the 256-token block
    hold 2 and 4 blocks, a graph each), here on the cpu: warmup compiles
    every forward a step can make, and the embeddings are HF's."""
    from vllm_accel.devices import DeviceBackend

    monkeypatch.setattr(DeviceBackend, "prefers_large_forwards", property(lambda self: True))
    model_dir = encoders("bert")
    with running_llm(model_dir, max_model_len=128, max_num_seqs=8,
                     additional_config={"accel": {"bucket_graphs": "per_bucket"}}) as llm:
        runner = model_runner(llm)
        assert runner.token_buckets[-3:] == [256, 512, 1024]
        prompts = token_ids(llm, TEXTS) * 3  # 3-106 tokens: steps of 2 blocks
        got = embed(llm, prompts)
        assert runner.compile_stats.runtime_compiles == 0
    for p, vector in zip(prompts, got):
        assert torch.allclose(vector, hf_embedding(model_dir, "bert", p), atol=TOL, rtol=0)


def test_a_generate_request_to_an_embedder_fails_and_it_keeps_serving(encoders):
    from vllm import SamplingParams

    model_dir = encoders("roberta")
    with running_llm(model_dir, **ENGINE) as llm:
        with pytest.raises(ValueError, match="generat"):
            llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(VLLMValidationError, match="maximum context length is 512"):
            embed(llm, [[5] * 600])
        assert len(embed(llm, [[5, 6, 7]])[0]) == 64


@pytest.mark.parametrize("kind,options,message", [
    # Without sentence-transformers' max_seq_length vLLM takes every row of
    # the table; RoBERTa's first padding_idx + 1 are no token's.
    ("roberta_without_max_seq_length", {},
     r"max_model_len=515 is longer than RobertaModel's position table allows: at most 512"),
    ("qwen3_embedder", dict(runner="pooling", convert="classify"),
     r"pools Qwen3ForCausalLM as an embedder only \(--convert embed\)"),
    ("bert", dict(tensor_parallel_size=2), r"tensor_parallel_size must be 1 with --runner pooling"),
])
def test_unsupported_pooling_configurations_fail_at_start_naming_the_setting(
        kind, options, message, encoders, tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    if kind.endswith("_without_max_seq_length"):  # a directory vLLM has not read
        model_dir = make_tiny_encoder(kind.removesuffix("_without_max_seq_length"), tmp_path)
        (model_dir / "sentence_bert_config.json").unlink()
    else:
        model_dir = encoders(kind)
    with pytest.raises(Exception, match=message):
        EngineArgs(model=str(model_dir), **options).create_engine_config()
