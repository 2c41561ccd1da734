"""Molmo through our platform (FMS port: our Qwen2 decoder + Molmo vision
backbone) against vLLM's own MolmoForCausalLM (tests/molmo_reference.py),
same fixture weights, float32, vLLM's own Molmo processing expanding prompts.

The reference runs as a full-recompute greedy loop (every step the whole
sequence from scratch, plain causal attention; vLLM's paged FlexAttention
matches it to 1e-4, test_molmo_fixture.py). Compared: greedy tokens (equal)
and the logprob of every generated token (close, LOGPROB_ATOL)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import molmo_reference
from molmo_reference import (
    build_vllm_molmo,
    image,
    molmo_checkpoint,
    plain_causal_attention,
    vllm_config,
    vllm_processor,
)

from helpers import model_runner, running_llm
from vllm_accel.testing.tiny_molmo import EMBEDDING_SIZE, MAX_CROPS, make_tiny_molmo

MAX_TOKENS = 8
# Observed: our logits match vLLM's to ~5e-6 (float32; fused vs unfused
# matmuls, FMS vs vLLM RMSNorm); logprobs are compared with room to spare.
LOGIT_ATOL = 1e-4
LOGPROB_ATOL = 1e-4
IM_PATCH = molmo_reference.IM_PATCH
# (width, height) -> crops (tiles + the global crop): every count 2..7.
SIZES = {(40, 40): 2, (80, 40): 3, (112, 40): 4, (80, 80): 5, (176, 40): 6, (112, 80): 7,
         (30, 120): 5}
ENGINE = dict(max_model_len=1024, limit_mm_per_prompt={"image": 2}, max_num_seqs=8,
              trust_remote_code=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return molmo_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(ckpt):
    model, config, _ = build_vllm_molmo(ckpt)
    processor, tokenizer = vllm_processor(vllm_config(ckpt))
    return model, processor, tokenizer


def prompt(question: str) -> str:
    return f"User: {question} Assistant:"  # the fixture's chat template


@pytest.fixture(scope="module")
def cases():
    single = [(prompt(f"Describe picture {i}."), [image(w, h, i)])
              for i, (w, h) in enumerate(SIZES)]
    two = [(prompt("Compare them."), [image(112, 80, 11), image(40, 80, 12)])]
    text = [(prompt("Tell me a story about a fox."), [])]
    return single + two + text


def reference_greedy(reference, text, images, max_tokens=MAX_TOKENS):
    return molmo_reference.reference_greedy(reference, text, images, max_tokens)


# An image no other test sends (nothing cached for it).
FRESH_CASE = (prompt("What colour dominates?"), [image(80, 80, seed=99)])
# New images of 2, 3, 4 and 2 crops in one batch: at most MAX_CROPS + 1 = 7
# (the largest bucket) crops a call, first fit: 2 + 3 + 2, then 4.
PACKED_CASES = [(prompt("Describe it."), [image(w, h, seed=50 + i)])
                for i, (w, h) in enumerate([(40, 40), (80, 40), (112, 40), (40, 40)])]
PACKED_CALLS = 2


@pytest.fixture(scope="module")
def expected(reference, cases):
    """Per case, then for FRESH_CASE (last). All computed before any engine
    shuts down (which tears down the distributed state vLLM's model needs)."""
    return [reference_greedy(reference, p, imgs)
            for p, imgs in cases + [FRESH_CASE] + PACKED_CASES]


@pytest.fixture(scope="module")
def llm(ckpt):
    with running_llm(ckpt, **ENGINE) as llm:
        yield llm


def generate(llm, cases, max_tokens=MAX_TOKENS):
    """(prompt ids, token ids, logprob of each token) per case, one batch."""
    from vllm import SamplingParams

    requests = [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else {"prompt": p}
                for p, imgs in cases]
    outs = llm.generate(requests, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                 logprobs=1), use_tqdm=False)
    results = []
    for o in outs:
        c = o.outputs[0]
        lps = [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]
        results.append((list(o.prompt_token_ids), list(c.token_ids), lps))
    return results


def assert_matches(got, want):
    g_prompt, g_tokens, g_lps = got
    w_prompt, w_tokens, w_lps, _ = want
    assert g_prompt == w_prompt
    assert g_tokens == w_tokens
    np.testing.assert_allclose(g_lps, w_lps, atol=LOGPROB_ATOL, rtol=0)


# ---- model level ----------------------------------------------------------

@pytest.mark.parametrize("decoder", ["qwen2", "olmo"])
def test_fms_model_loads_every_weight_and_matches_vllm_logits(tmp_path, ckpt, decoder):
    """load_fms_model on the hub layout (both decoders): every weight loaded,
    prefill logits of a prompt with an image equal vLLM's within LOGIT_ATOL."""
    from transformers import AutoConfig

    from vllm.multimodal.inputs import MultiModalKwargsItems
    from vllm_accel.model.fms_causal_lm import load_fms_model
    from port_helpers import image_embeddings

    path = ckpt if decoder == "qwen2" else make_tiny_molmo(tmp_path / decoder, decoder=decoder)
    hf_config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_fms_model(str(path), hf_config, torch.float32)
    ours = load_fms_model(str(path), hf_config, torch.float32, trust_remote_code=True)
    text = ours.language_model.config
    assert (text.qk_norm, text.norm_after, text.attn_bias) == (
        (True, True, False) if decoder == "olmo" else (False, False, True))

    ref, config, _ = build_vllm_molmo(path)
    processor, tokenizer = vllm_processor(config)
    out = processor(tokenizer.encode(prompt("Describe."), add_special_tokens=False),
                    processor.info.parse_mm_data({"image": [image(112, 80)]}))
    ids = torch.tensor(out["prompt_token_ids"])
    (item,) = out["mm_kwargs"]["image"]
    data = {k: v.data for k, v in item.items()}
    is_patch = ids == IM_PATCH
    with torch.no_grad(), plain_causal_attention():
        (ref_img,) = ref.embed_multimodal(**MultiModalKwargsItems({"image": [item]}).get_data())
        want = ref.compute_logits(ref(None, torch.arange(len(ids)),
                                      inputs_embeds=ref.embed_input_ids(
                                          ids, [ref_img], is_multimodal=is_patch)))
        ours_img = image_embeddings(ours.vision, data["images"], data["image_masks"],
                                    data["image_input_idx"])
        embeds = ours.language_model.base_model.embedding(ids)
        embeds[is_patch] = ours_img
        got = ours.language_model(embeds[None])[0]
    torch.testing.assert_close(ours_img, ref_img, atol=1e-5, rtol=0)
    assert got.shape == want.shape == (len(ids), EMBEDDING_SIZE)
    torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=0)


# ---- through the engine -----------------------------------------------------

def test_each_case_matches_vllm_molmo(llm, cases, expected):
    for case, want in zip(cases, expected):
        assert_matches(generate(llm, [case])[0], want)


@pytest.mark.slow
def test_mixed_batch_equals_singles_and_reference(llm, cases, expected):
    for got, want in zip(generate(llm, cases), expected):
        assert_matches(got, want)


@pytest.mark.slow
def test_images_of_a_step_share_encoder_calls(llm, expected):
    encoder = model_runner(llm).vision_encoder
    images, calls = encoder.images_encoded, encoder.calls
    for got, want in zip(generate(llm, PACKED_CASES), expected[-len(PACKED_CASES):]):
        assert_matches(got, want)
    assert (encoder.images_encoded - images, encoder.calls - calls) == \
        (len(PACKED_CASES), PACKED_CALLS)


def test_image_token_counts_equal_vllm_processing(llm, cases, reference):
    _, processor, tokenizer = reference
    for (text, images), (prompt_ids, _, _) in zip(cases, generate(llm, cases, 1)):
        n_patch = prompt_ids.count(IM_PATCH)
        info = processor.info
        ip = info.get_hf_processor().image_processor
        want = 0
        for img in images:
            ncols, nrows = info.get_patches_grid_size(image_width=img.width,
                                                      image_height=img.height,
                                                      image_processor=ip)
            want += ip.image_token_length_w * ip.image_token_length_h + \
                ((ncols + 1) // 2) * ((nrows + 1) // 2)
        assert n_patch == want


@pytest.mark.slow
def test_chunk_boundary_inside_an_image(ckpt, cases, expected):
    # (112, 80): a 44 + 2 + 7 * 4 token placeholder from offset 1; 16-token
    # chunks end inside it several times.
    case, want = cases[5], expected[5]
    with running_llm(ckpt, max_num_batched_tokens=16, **ENGINE) as chunked:
        encoder = model_runner(chunked).vision_encoder
        before = encoder.images_encoded
        assert_matches(generate(chunked, [case])[0], want)
        assert encoder.images_encoded - before == 1  # one image, once across chunks


@pytest.mark.slow
def test_encoder_once_per_image_never_in_decode(llm, cases, expected):
    encoder = model_runner(llm).vision_encoder
    before = encoder.images_encoded
    got = generate(llm, [FRESH_CASE, FRESH_CASE])
    assert encoder.images_encoded - before == 1
    for g in got:
        assert_matches(g, expected[len(cases)])


def test_default_vision_buckets_are_crop_counts(llm):
    assert model_runner(llm).vision_encoder.buckets == list(range(2, MAX_CROPS + 2))


@pytest.mark.slow
def test_compiled_serving_pads_crops_and_never_recompiles(ckpt, cases, expected, tmp_path):
    """Coarse crop buckets: images of 2-3 crops run padded to 4, of 5-6 to 7
    (zero crops and zero masks), the ViT blocks compiled with inductor."""
    config = {"accel": {"compile_backend": "inductor", "token_buckets": "64,256",
                        "multimodal_buckets": "4,7", "compile_cache_dir": str(tmp_path)}}
    with running_llm(ckpt, additional_config=config, max_num_batched_tokens=256,
                     **ENGINE) as llm:
        runner = model_runner(llm)
        assert runner.vision_encoder.buckets == [4, 7]
        stats = runner.compile_stats
        assert stats.warmup_graphs == 1 + 1 + 1  # decoder layers', final norm's, ViT's: each shared
        # Warmup ran the ViT's graphs in its first block only; the others
        # passed through, and serving finds every block's graph unguarded.
        blocks = runner.vision_encoder.adapter.vision_compile_units()
        guarded = [block.forward.guarded_calls for block in blocks]
        assert guarded == [2] + [0] * (len(blocks) - 1)
        got = generate(llm, cases)
        assert stats.runtime_compiles == 0
        assert [block.forward.guarded_calls for block in blocks] == guarded
    for g, want in zip(got, expected):
        assert_matches(g, want)


# ---- derived limits ----------------------------------------------------------

@pytest.mark.slow
def test_max_model_len_derived_and_too_long_prompt_rejected(ckpt):
    """max_model_len defaults to the config's max_position_embeddings (4096);
    a prompt longer than that once its image is expanded is rejected with a
    VLLMValidationError (vLLM's own check; HTTP 400 over the API) naming its
    length and the limit."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    options = {k: v for k, v in ENGINE.items() if k != "max_model_len"}
    with running_llm(ckpt, max_model_len=None, **options) as llm:
        assert llm.llm_engine.model_config.max_model_len == 4096
        ids = [58] * 4060  # fits alone; not with the image's ~100 placeholder tokens
        with pytest.raises(VLLMValidationError) as error:
            llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [image(80, 80)]}},
                         SamplingParams(max_tokens=1), use_tqdm=False)
        message = str(error.value)
        length = int(re.search(r"prompt \(length (\d+)\)", message).group(1))
        assert length > len(ids) + 1 and "maximum model length of 4096" in message, message


@pytest.mark.slow
def test_max_model_len_beyond_the_config_fails_at_start_up(ckpt):
    with pytest.raises(Exception, match="max_model_len") as error:
        with running_llm(ckpt, max_model_len=8192, **{k: v for k, v in ENGINE.items()
                                                      if k != "max_model_len"}):
            pass
    assert "4096" in str(error.value) and "8192" in str(error.value)


@pytest.mark.slow
def test_olmo_decoder_through_the_engine(tmp_path, cases):
    """Molmo-7B-O's layout (OLMo decoder; vocab_size below the head's rows):
    a single image, two images and text only, against vLLM's own Molmo."""
    path = make_tiny_molmo(tmp_path / "olmo", decoder="olmo")
    model, config, _ = build_vllm_molmo(path)
    processor, tokenizer = vllm_processor(config)
    picked = [cases[5], cases[-2], cases[-1]]
    want = [reference_greedy((model, processor, tokenizer), p, imgs) for p, imgs in picked]
    with running_llm(path, **ENGINE) as llm:
        got = generate(llm, picked)
    for g, w in zip(got, want):
        assert_matches(g, w)
