"""MolmoE-1B (OLMoForCausalLM: Molmo's vision side, an OLMoE decoder) through
our platform against its oracle (tests/molmoe_reference.py: transformers'
own OlmoeForCausalLM holding the fixture's decoder weights, fed the prompt
with our Molmo vision backbone's image embeddings merged in), float32,
greedy, vLLM's own Molmo processing expanding the prompts.

Fast: the fixture's hub layout, the settings the port refuses, the decoder's
logits against OLMoE's, and one engine for every case: text prompts (the
decoder; renormalizing the top-k weights would change their answers, and
that is checked), images of several sizes and aspect ratios, two images,
text only. Slow: the same cases compiled (inductor), in 32-token prefill
chunks that end inside the images, nothing compiled while serving; and
MolmoE-1B's published widths, depth cut, loading and generating."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from molmo_reference import image, isolate_remote_code_cache, vllm_config, vllm_processor
from molmoe_reference import olmoe_decoder, reference_greedy, vision_backbone

from helpers import model_runner, running_llm
from vllm_accel.testing.tiny_molmo import EMBEDDING_SIZE
from vllm_accel.testing.tiny_molmoe import REAL_WIDTHS, TextWidths, make_tiny_molmoe

MAX_TOKENS = 10
ENGINE = dict(max_model_len=1024, limit_mm_per_prompt={"image": 2}, max_num_seqs=16,
              trust_remote_code=True)


def prompt(question: str) -> str:
    return f"User: {question} Assistant:"  # the fixture's chat template


# The decoder alone (no image): token-exact with OLMoE.
TEXT_CASES = [(prompt(q), []) for q in ("Tell me a story about a fox.", "What is 2 + 2?",
                                        "Name three colours.", "Write a haiku about rain.")]
# 2, 4, 5 (tall) and 7 crops, then two images.
IMAGE_CASES = [(prompt(f"Describe picture {i}."), [image(w, h, i)])
               for i, (w, h) in enumerate([(40, 40), (112, 40), (30, 120), (112, 80)])]
IMAGE_CASES.append((prompt("Compare them."), [image(112, 80, 11), image(40, 80, 12)]))
CASES = TEXT_CASES + IMAGE_CASES


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    isolate_remote_code_cache(tmp_path_factory.getbasetemp() / "hf_modules")
    return make_tiny_molmoe(tmp_path_factory.mktemp("molmoe") / "m")


@pytest.fixture(scope="module")
def processing(ckpt):
    return vllm_processor(vllm_config(ckpt))


def oracle(ckpt, processing, renormalize=False, cases=CASES):
    processor, tokenizer = processing
    reference = (olmoe_decoder(ckpt, renormalize), vision_backbone(ckpt), processor, tokenizer,
                 EMBEDDING_SIZE)
    return [reference_greedy(reference, p, imgs, MAX_TOKENS) for p, imgs in cases]


@pytest.fixture(scope="module")
def expected(ckpt, processing):
    return oracle(ckpt, processing)


@pytest.fixture(scope="module")
def llm(ckpt):
    with running_llm(ckpt, **ENGINE) as llm:
        yield llm


def generate(llm, cases):
    """(prompt ids, greedy ids) per case, as one batch."""
    from vllm import SamplingParams

    requests = [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else {"prompt": p}
                for p, imgs in cases]
    outs = llm.generate(requests, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]


# ---- the fixture and the config --------------------------------------------


def test_fixture_has_the_hub_layout(ckpt):
    from safetensors import safe_open

    config = json.loads((ckpt / "config.json").read_text())
    assert (config["architectures"], config["model_type"]) == (["OLMoForCausalLM"], "molmo")
    assert {"d_model", "n_heads", "n_layers", "moe_num_experts", "moe_top_k", "mlp_hidden_size",
            "vision_backbone", "vit_layers"} <= set(config)
    assert not {"hidden_size", "num_attention_heads", "intermediate_size"} & set(config)
    with safe_open(ckpt / "model.safetensors", "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    width = TextWidths().expert_width
    p = "model.transformer.blocks.1."
    assert shapes[p + "ffn.router.layer.weight"] == (8, 256)
    for w in ("w1", "v1", "w2"):
        assert shapes[f"{p}ffn.experts.mlp.{w}"] == (8 * width, 256)
    assert shapes[p + "att_proj.weight"] == (3 * 256, 256)  # multi-head: q, k, v alike
    assert shapes["model.transformer.ff_out.weight"] == (EMBEDDING_SIZE, 256)


def _config(ckpt, **changes):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ckpt, trust_remote_code=True)
    for key, value in changes.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("setting, value", [
    ("rope_impl", "cockatoo"), ("moe_shared_expert", True), ("moe_interleave", True),
    ("moe_dropless", False), ("n_kv_heads", 2), ("include_bias", True), ("qkv_bias", True),
    ("clip_qkv", 8.0), ("weight_tying", True), ("layer_norm_type", "default"),
    ("activation_type", "gelu"), ("image_pooling_2d", "attention"), ("alibi", True),
])
def test_settings_the_port_does_not_compute_are_refused_naming_them(ckpt, setting, value):
    from vllm_accel.model.molmoe import molmoe_config_from_hf

    with pytest.raises(ValueError, match=rf"MolmoE \(OLMoForCausalLM\) with {setting}="):
        molmoe_config_from_hf(_config(ckpt, **{setting: value}))


def test_a_setting_the_config_lacks_means_olmo_default(ckpt):
    from vllm_accel.model.molmoe import molmoe_config_from_hf

    config = _config(ckpt)
    del config.rope_impl  # OLMo's default: rotary on interleaved pairs
    with pytest.raises(ValueError, match=r"with rope_impl='cockatoo': it computes "
                       r"rope_impl='llama' \(MolmoE-1B-0924's\) only"):
        molmoe_config_from_hf(config)


def test_a_text_olmo_checkpoint_is_refused(ckpt):
    from vllm_accel.model.molmoe import molmoe_config_from_hf

    with pytest.raises(ValueError, match=r"OLMoForCausalLM as MolmoE-1B only .* block_type="
                       r"'sequential' and no vision_backbone"):
        molmoe_config_from_hf(_config(ckpt, block_type="sequential", vision_backbone=None))


def test_experts_named_otherwise_fail_naming_the_layout():
    from vllm_accel.model.molmoe import _hf_to_fms_names

    with pytest.raises(ValueError, match=r"ffn.gate.weight.*megablocks' layout"):
        _hf_to_fms_names({"model.transformer.blocks.0.ffn.gate.weight": torch.zeros(1)})


def test_vllm_resolves_it_to_molmo_processing_and_we_to_molmo_vision(ckpt, processing):
    from vllm_accel.multimodal.mm_mappings import vision_adapter_class
    from vllm_accel.multimodal.mm_mappings.molmo import MolmoVisionAdapter

    processor, _ = processing
    assert type(processor).__name__ == "MolmoMultiModalProcessor"
    assert vision_adapter_class(_config(ckpt)) is MolmoVisionAdapter


# ---- model level -------------------------------------------------------------


def test_decoder_logits_equal_olmoe(ckpt):
    """Our decoder (experts as the engine runs them) on token ids: OLMoE's
    logits within 1e-4; OLMoE renormalizing its top-k weights differs."""
    from vllm_accel.model import experts
    from vllm_accel.model.fms_causal_lm import load_fms_model

    ours = load_fms_model(str(ckpt), _config(ckpt), torch.float32, trust_remote_code=True)
    assert experts.install(ours) == 2
    ids = torch.randint(0, EMBEDDING_SIZE - 8, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = ours.language_model(ids)[0]
        want, renormalized = (olmoe_decoder(ckpt, r)(ids).logits[0, :, :EMBEDDING_SIZE]
                              for r in (False, True))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert (got - renormalized).abs().max() > 0.1


# ---- through the engine ----------------------------------------------------------


def test_each_case_matches_the_oracle(expected, llm, ckpt, processing):
    got = generate(llm, CASES)
    assert got == [tuple(want) for want in expected]
    # Not vacuous: the images steer the answers, and an engine that
    # renormalized the top-k weights would answer some text prompts otherwise.
    assert len({tuple(tokens) for _, tokens in got[len(TEXT_CASES):]}) > 1
    renormalized = oracle(ckpt, processing, renormalize=True, cases=TEXT_CASES)
    assert any(a != b for a, b in zip(renormalized, expected))


@pytest.mark.slow
def test_compiled_chunked_serving_matches_and_never_recompiles(ckpt, expected, tmp_path):
    """Inductor, one token bucket (32) and one crop bucket (7): 32-token
    prefill chunks end inside every image; each image encoded once; no
    compile while serving."""
    config = {"accel": {"compile_backend": "inductor", "token_buckets": "32",
                        "multimodal_buckets": "7", "compile_cache_dir": str(tmp_path)}}
    with running_llm(ckpt, additional_config=config, max_num_batched_tokens=32,
                     **ENGINE) as llm:
        runner = model_runner(llm)
        stats, encoder = runner.compile_stats, runner.vision_encoder
        assert stats.warmup_graphs == 1 + 1 + 1  # decoder layers', final norm's, ViT's
        before = encoder.images_encoded
        got = generate(llm, CASES)
        assert stats.runtime_compiles == 0
        assert encoder.images_encoded - before == sum(len(imgs) for _, imgs in CASES)
    assert got == [tuple(want) for want in expected]


@pytest.mark.slow
def test_real_widths_load_and_generate(tmp_path):
    """MolmoE-1B's published decoder widths (d_model 2048, 16 heads, 64
    experts top-8 of width 1024, 50280 tokens in 50304 rows + 128) with 1 of
    its 16 layers, Molmo-7B's ViT widths with 9 of its 23 blocks (the fewest
    that hold the feature layers -2 and -9), random bfloat16 weights: loads
    and generates from an image and from text."""
    from vllm import SamplingParams

    isolate_remote_code_cache(tmp_path / "hf_modules")
    path = make_tiny_molmoe(tmp_path / "real", text=dataclasses.replace(REAL_WIDTHS, n_layers=1),
                            vision="full", vit_layers=9, dtype=torch.bfloat16)
    config = {"accel": {"skip_warmup": True}}
    with running_llm(path, dtype="bfloat16", additional_config=config, **ENGINE) as llm:
        assert llm.llm_engine.model_config.get_vocab_size() == 50280
        model = model_runner(llm).model
        moe = model.fms_model.base_model.layers[0].ff_sub_layer
        assert (model.hidden_size, model.num_heads, model.logits_width) == (2048, 16, 50304)
        assert (moe.num_experts, moe.top_k, moe.intermediate, moe.renormalize) == \
            (64, 8, 1024, False)
        requests = [{"prompt": prompt("Describe it."),
                     "multi_modal_data": {"image": [image(300, 200, 1)]}},
                    {"prompt": prompt("Tell me a story.")}]
        outs = llm.generate(requests, SamplingParams(temperature=0, max_tokens=4,
                                                     detokenize=False), use_tqdm=False)
    for out in outs:
        tokens = out.outputs[0].token_ids
        assert len(tokens) == 4 and all(0 <= t < 50304 for t in tokens), tokens
    assert len(outs[0].prompt_token_ids) > 150  # the image's placeholders
