"""The tiny Molmo fixture: offline loading with transformers (remote code),
vLLM's own Molmo processing on it (prompt expansion, placeholders, token
counts), and vLLM's own MolmoForCausalLM built on CPU with its weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from molmo_reference import (
    build_vllm_molmo,
    isolate_remote_code_cache,
    paged_forward,
    plain_causal_attention,
    vllm_config,
    vllm_processor,
)
from PIL import Image

from vllm_accel.testing.tiny_molmo import (
    EMBEDDING_SIZE,
    IMAGE_TOKENS,
    MAX_CROPS,
    make_tiny_molmo,
)

IM_START, IM_END, IM_PATCH, IM_COL = range(EMBEDDING_SIZE, EMBEDDING_SIZE + 4)
ENDOFTEXT = EMBEDDING_SIZE - 8  # 384: first token after the 384 BPE tokens
# (width, height) -> tiles (rows x cols) for 32 px windows + 16 px margins:
# 1x1, 1x2, 1x3, 2x2, 1x5, 2x3 (so 2..7 crops with the global one), tall
# 2x1 and 4x1, and images that must shrink or are smaller than the margins.
SIZES = {(40, 40): 1, (80, 40): 2, (112, 40): 3, (80, 80): 4, (176, 40): 5, (112, 80): 6,
         (40, 80): 2, (30, 120): 4, (640, 480): 6, (12, 20): 1}


def image(width, height, seed=0):
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype(np.uint8))


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    isolate_remote_code_cache(tmp_path_factory.getbasetemp() / "hf_modules")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, hf_home):
    return make_tiny_molmo(tmp_path_factory.mktemp("molmo") / "m")


@pytest.fixture(scope="module")
def processing(ckpt):
    return vllm_processor(vllm_config(ckpt))


def test_deterministic_and_small(ckpt, tmp_path):
    again = make_tiny_molmo(tmp_path / "again")
    for name in ("model.safetensors", "config.json", "tokenizer.json",
                 "preprocessor_config.json", "preprocessing_molmo.py"):
        assert (ckpt / name).read_bytes() == (again / name).read_bytes(), name
    total = sum(f.stat().st_size for f in ckpt.iterdir())
    assert total < 10 * 2**20


def test_transformers_loads_offline(ckpt):
    from transformers import AutoConfig, AutoProcessor

    cfg = AutoConfig.from_pretrained(ckpt, trust_remote_code=True)
    assert cfg.model_type == "molmo" and cfg.architectures == ["MolmoForCausalLM"]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads) == (256, 2, 4, 2)
    assert cfg.qkv_bias and not cfg.attention_layer_norm and not cfg.norm_after
    assert cfg.embedding_size == cfg.vocab_size == EMBEDDING_SIZE
    assert cfg.max_position_embeddings == 4096 and not cfg.weight_tying

    proc = AutoProcessor.from_pretrained(ckpt, trust_remote_code=True)
    ip, tok = proc.image_processor, proc.tokenizer
    assert (ip.max_crops, ip.overlap_margins, ip.base_image_input_size, ip.image_patch_size,
            ip.image_token_length_w, ip.image_token_length_h) == (MAX_CROPS, [2, 2], [48, 48],
                                                                  4, 6, 6)
    assert tok.bos_token_id is None and tok.eos_token_id == ENDOFTEXT
    assert tok.convert_tokens_to_ids(list(IMAGE_TOKENS)) == list(range(EMBEDDING_SIZE,
                                                                        EMBEDDING_SIZE + 5))
    assert tok.encode("Hello", add_special_tokens=True) == tok.encode("Hello",
                                                                     add_special_tokens=False)
    assert tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi?"}]}],
        add_generation_prompt=True, tokenize=False) == "User: Hi? Assistant:"


def test_hf_processor_layout(ckpt):
    """Our processor alone: bos, image tokens first, image_input_idx points at
    every <im_patch> exactly once, crop count = tiles + 1."""
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(ckpt, trust_remote_code=True)
    sizes = [(112, 80), (40, 80)]
    out = proc.process("Describe.", [image(w, h, i) for i, (w, h) in enumerate(sizes)])
    ids, idx = out["input_ids"], out["image_input_idx"]
    assert ids[0] == ENDOFTEXT and ids[1] == IM_START
    assert out["images"].shape == (sum(SIZES[s] + 1 for s in sizes), 144, 48)
    assert out["image_masks"].shape == out["images"].shape[:2]
    assert idx.shape == (out["images"].shape[0], 36)
    used = idx[idx >= 0]
    assert sorted(used.tolist()) == torch.nonzero(ids == IM_PATCH).squeeze(1).tolist()
    text = proc.tokenizer.decode(ids[torch.nonzero(ids == IM_END).max() + 1:])
    assert text == " User: Describe. Assistant:"


@pytest.mark.parametrize("sizes", [[s] for s in SIZES] + [[(112, 80), (40, 80)],
                                                          [(30, 120), (640, 480)]],
                         ids=lambda sizes: "+".join(f"{w}x{h}" for w, h in sizes))
def test_vllm_processing(ckpt, processing, sizes):
    """vLLM's Molmo processing on the fixture: it expands the prompt exactly as
    our processor does, and its own token-count formula agrees."""
    from transformers import AutoProcessor

    processor, tokenizer = processing
    images = [image(w, h, i) for i, (w, h) in enumerate(sizes)]
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": "Describe."}]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                           add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    out = processor(ids, processor.info.parse_mm_data({"image": images}))

    hf = AutoProcessor.from_pretrained(ckpt, trust_remote_code=True).process("Describe.", images)
    assert out["prompt_token_ids"] == hf["input_ids"].tolist()

    items = list(out["mm_kwargs"]["image"])
    placeholders = list(out["mm_placeholders"]["image"])
    image_processor = processor.info.get_hf_processor().image_processor
    offset = 1  # after the bos
    for img, size, item, ph in zip(images, sizes, items, placeholders):
        crops = SIZES[size] + 1
        assert int(item["num_crops"].data) == crops
        assert item["images"].data.shape == (crops, 144, 48)
        assert item["image_input_idx"].data.shape == (crops, 36)
        assert ph.offset == offset
        assert ph.length == processor.info.get_num_image_tokens(
            image_width=img.width, image_height=img.height, image_processor=image_processor)
        assert ph.is_embed is not None
        tokens = torch.tensor(out["prompt_token_ids"][ph.offset:ph.offset + ph.length])
        assert torch.equal(ph.is_embed, tokens == IM_PATCH)
        assert int(ph.is_embed.sum()) == int((item["image_input_idx"].data >= 0).sum())
        offset += ph.length


def test_vllm_dummy_inputs(processing):
    """The profiling path: vLLM's largest-image dummy goes through processing."""
    processor, _ = processing
    size = processor.info.get_image_size_with_most_features()
    mm_data = processor.dummy_inputs.get_dummy_mm_data(2048, {"image": 1}, {})
    out = processor([], processor.info.parse_mm_data(mm_data))
    (item,) = out["mm_kwargs"]["image"]
    assert int(item["num_crops"].data) == MAX_CROPS + 1, size


@pytest.mark.parametrize("decoder", ["qwen2", "olmo"])
def test_vllm_model_loads_every_parameter(tmp_path, hf_home, decoder):
    ckpt = make_tiny_molmo(tmp_path / decoder, decoder=decoder)
    model, _, loaded = build_vllm_molmo(ckpt)
    params = {name for name, _ in model.named_parameters()}
    assert loaded == params
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all() and p.abs().sum() > 0, name
    # (vLLM pads both tables' rows to a multiple of 64)
    assert model.lm_head.num_embeddings == EMBEDDING_SIZE
    assert model.model.embed_tokens.num_embeddings == EMBEDDING_SIZE + 128
    attn = model.model.layers[0].self_attn
    if decoder == "olmo":
        assert attn.q_norm is not None and attn.num_kv_heads == 4
        assert type(model.model.layers[0]).__name__ == "MolmoDecoderNormAfterLayer"
    else:
        assert attn.q_norm is None and attn.num_kv_heads == 2


def test_vllm_model_runs_on_cpu(ckpt, processing):
    """vLLM's whole Molmo on CPU outside an engine, for a prompt with an image:
    its vision backbone as is; its decoder through vLLM's FlexAttention with a
    paged KV cache (paged_forward), which plain causal attention matches."""
    model, config, _ = build_vllm_molmo(ckpt)
    processor, tokenizer = processing
    prompt = "User: Describe. Assistant:"
    out = processor(tokenizer.encode(prompt, add_special_tokens=False),
                    processor.info.parse_mm_data({"image": [image(112, 80)]}))
    (item,) = out["mm_kwargs"]["image"]
    from vllm.multimodal.inputs import MultiModalKwargsItems

    with torch.no_grad():
        (embeds,) = model.embed_multimodal(**MultiModalKwargsItems({"image": [item]}).get_data())
        ids = torch.tensor(out["prompt_token_ids"])
        assert embeds.shape == (int((ids == IM_PATCH).sum()), 256)
        assert 0.03 < float(embeds.std()) < 0.3  # like token embeddings (std 0.1)
        inputs = model.embed_input_ids(ids, [embeds], is_multimodal=ids == IM_PATCH)
        hidden = paged_forward(model, config, ids, torch.arange(len(ids)), inputs_embeds=inputs)
        with plain_causal_attention():
            plain = model(ids, torch.arange(len(ids)), inputs_embeds=inputs)
        logits = model.compute_logits(hidden)
    torch.testing.assert_close(plain, hidden, atol=1e-4, rtol=0)
    assert logits.shape == (len(ids), EMBEDDING_SIZE) and torch.isfinite(logits).all()
    assert len(set(logits.argmax(-1).tolist())) > 5
