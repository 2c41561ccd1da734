"""A tiny, deterministic, offline Qwen2.5-VL checkpoint for tests.

Written from scratch (no model hub): config.json (Qwen2_5_VLConfig),
model.safetensors in the key layout real hub checkpoints use
(``model.embed_tokens``, ``model.layers.*``, ``model.norm``, ``visual.*``,
``lm_head`` unless tied), the byte-level BPE tokenizer of tiny_models.py plus
Qwen's special tokens, a Qwen2-VL image processor config with small pixel
limits (a few dozen patches per image), a processor config, a ChatML chat
template that renders OpenAI-style content lists, and a generation config.

Loads with transformers' ``Qwen2_5_VLForConditionalGeneration`` and
``AutoProcessor`` without torchvision once
``vllm_accel.patches.apply_patches()`` has run (it stands in for the
torchvision-only video processor).

Usage:
    from vllm_accel.testing.tiny_qwen2_5_vl import make_tiny_qwen2_5_vl
    path = make_tiny_qwen2_5_vl(tmp_path / "tiny-qwen2_5_vl", seed=0)
"""

from __future__ import annotations

import json
import os
import pathlib

import torch
from safetensors.torch import save_file

from vllm_accel.testing.tiny_models import (
    EOS,
    NORM_NOISE,
    SPECIAL_TOKENS,
    SUPPRESS_SCALE,
    WEIGHT_STD,
    _save_tokenizer,
    _unprintable_ids,
    build_tokenizer,
)

# Text model: GQA (4 query heads over 2 KV heads), head_dim 64, M-RoPE with
# 8 temporal, 12 height and 12 width frequencies (sum = head_dim / 2).
HIDDEN = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 224
MROPE_SECTION = [8, 12, 12]
ROPE_THETA = 10_000.0
MAX_POS = 4096

# Vision tower: 14-pixel patches over 2 frames, 2x2 merge, 112-pixel windows
# (4x4 merged tokens) with full attention in blocks 1 and 3.
VISION_HIDDEN = 64
VISION_HEADS = 4  # head_dim 16
VISION_INTERMEDIATE = 128
VISION_DEPTH = 4
PATCH_SIZE = 14
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2
WINDOW_SIZE = 112
FULLATT_BLOCK_INDEXES = [1, 3]
# Images are resized to between 4 and 64 merged tokens (28x28 pixels each).
MIN_PIXELS = 28 * 28 * 4
MAX_PIXELS = 28 * 28 * 64
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
QWEN_TOKENS = [IM_START, IM_END, VISION_START, VISION_END, VIDEO_PAD]  # appended after the BPE vocab

VISION_SEED_OFFSET = 1_000_003
BIAS_STD = 0.02  # non-zero so an unloaded bias is detectable
PATCH_EMBED_STD = 0.03  # 1176 inputs per patch
MERGER_OUT_STD = 0.02  # image features enter the residual stream like embeddings

# ChatML, like Qwen2.5-VL's: an image part renders as
# <|vision_start|><|image_pad|><|vision_end|>, which the processor expands.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)


def _tokenizer():
    from tokenizers import AddedToken, processors

    tokenizer = build_tokenizer(image_token=IMAGE_PAD, chat_template=CHAT_TEMPLATE)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_TOKENS],
                         special_tokens=True)
    # Qwen tokenizers add no bos: prompts are exactly what the template renders.
    tokenizer.backend_tokenizer.post_processor = processors.Sequence([])
    return tokenizer


def _hf_config(tokenizer, tie_word_embeddings: bool):
    from transformers import Qwen2_5_VLConfig

    ids = tokenizer.convert_tokens_to_ids
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA,
                         "mrope_section": list(MROPE_SECTION)},
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=ids(IM_END),
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    vision = dict(
        depth=VISION_DEPTH,
        hidden_size=VISION_HIDDEN,
        intermediate_size=VISION_INTERMEDIATE,
        num_heads=VISION_HEADS,
        in_channels=3,
        patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE,
        window_size=WINDOW_SIZE,
        fullatt_block_indexes=list(FULLATT_BLOCK_INDEXES),
        out_hidden_size=HIDDEN,
        hidden_act="silu",
        tokens_per_second=2,
    )
    cfg = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids(IMAGE_PAD),
        video_token_id=ids(VIDEO_PAD),
        vision_start_token_id=ids(VISION_START),
        vision_end_token_id=ids(VISION_END),
        tie_word_embeddings=tie_word_embeddings,
        dtype="float32",
    )
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    return cfg


def _text_state_dict(vocab: int, seed: int, *, tie: bool, suppressed: list[int]) -> dict:
    """Qwen2 text weights in hub layout, drawn in a fixed order."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, std=WEIGHT_STD):
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std

    def norm():
        return 1.0 + NORM_NOISE * torch.randn(HIDDEN, generator=g, dtype=torch.float32)

    head_dim = HIDDEN // HEADS
    embed = normal(vocab, HIDDEN)
    sd = {"model.embed_tokens.weight": embed}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm()
        for name, rows in (("q_proj", HEADS), ("k_proj", KV_HEADS), ("v_proj", KV_HEADS)):
            sd[p + f"self_attn.{name}.weight"] = normal(rows * head_dim, HIDDEN)
            sd[p + f"self_attn.{name}.bias"] = normal(rows * head_dim, std=BIAS_STD)
        sd[p + "self_attn.o_proj.weight"] = normal(HIDDEN, HEADS * head_dim)
        sd[p + "post_attention_layernorm.weight"] = norm()
        sd[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        sd[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        sd[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
    sd["model.norm.weight"] = norm()
    # Tokens that should never be generated get tiny output rows (with tied
    # weights that also shrinks their input embeddings; both stay non-zero).
    head = embed if tie else normal(vocab, HIDDEN)
    head[suppressed] *= SUPPRESS_SCALE
    if not tie:
        sd["lm_head.weight"] = head
    return sd


def _vision_state_dict(seed: int) -> dict:
    """Vision tower in hub layout (``visual.*``), drawn in a fixed order."""
    g = torch.Generator().manual_seed(seed + VISION_SEED_OFFSET)

    def normal(*shape, std=WEIGHT_STD):
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std

    def linear(sd, name, out_dim, in_dim, std=WEIGHT_STD):
        sd[name + ".weight"] = normal(out_dim, in_dim, std=std)
        sd[name + ".bias"] = normal(out_dim, std=BIAS_STD)

    def norm(dim):
        return 1.0 + NORM_NOISE * torch.randn(dim, generator=g, dtype=torch.float32)

    h, inter = VISION_HIDDEN, VISION_INTERMEDIATE
    sd = {"visual.patch_embed.proj.weight": normal(
        h, 3, TEMPORAL_PATCH_SIZE, PATCH_SIZE, PATCH_SIZE, std=PATCH_EMBED_STD)}
    for i in range(VISION_DEPTH):
        p = f"visual.blocks.{i}."
        sd[p + "norm1.weight"] = norm(h)
        linear(sd, p + "attn.qkv", 3 * h, h)
        linear(sd, p + "attn.proj", h, h)
        sd[p + "norm2.weight"] = norm(h)
        linear(sd, p + "mlp.gate_proj", inter, h)
        linear(sd, p + "mlp.up_proj", inter, h)
        linear(sd, p + "mlp.down_proj", h, inter)
    merged = h * MERGE_SIZE**2
    sd["visual.merger.ln_q.weight"] = norm(h)
    linear(sd, "visual.merger.mlp.0", merged, merged)
    linear(sd, "visual.merger.mlp.2", HIDDEN, merged, std=MERGER_OUT_STD)
    return sd


def _write_json(path: pathlib.Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_processor_files(out: pathlib.Path, tokenizer, processor_class: str, *,
                          patch_size: int, min_pixels: int, max_pixels: int, mean: list[float],
                          std: list[float], video_processor_type: str | None = None) -> None:
    """A Qwen-VL checkpoint's generation config (stop on <|im_end|> or eos),
    Qwen2-VL image processor config (2-frame patches merged 2x2), processor
    config and, given ``video_processor_type``, video processor config (as
    Qwen3-VL's on the hub: without torchvision, vllm_accel's stand-in of that
    name loads it)."""
    from transformers import GenerationConfig

    GenerationConfig(
        eos_token_id=[tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(EOS)],
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out)
    shared = {"image_mean": mean, "image_std": std, "max_pixels": max_pixels,
              "merge_size": MERGE_SIZE, "min_pixels": min_pixels, "patch_size": patch_size,
              "processor_class": processor_class, "temporal_patch_size": TEMPORAL_PATCH_SIZE}
    _write_json(out / "preprocessor_config.json", {
        **shared,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_processor_type": "Qwen2VLImageProcessor",
        "resample": 3,  # bicubic
        "rescale_factor": 1 / 255,
    })
    if video_processor_type is not None:
        _write_json(out / "video_preprocessor_config.json",
                    {**shared, "video_processor_type": video_processor_type})
    _write_json(out / "processor_config.json", {"processor_class": processor_class})


def make_tiny_qwen2_5_vl(
    out_dir: str | os.PathLike, seed: int = 0, *, tie_word_embeddings: bool = True,
    printable_only: bool = True,
) -> pathlib.Path:
    """Write the checkpoint into ``out_dir`` and return it. Same bytes for the
    same arguments and library versions. ``tie_word_embeddings`` (default, as
    Qwen2.5-VL-3B) leaves ``lm_head`` out of the safetensors. With
    ``printable_only`` the output rows of special and non-printable tokens are
    shrunk, so greedy output is printable text that never hits eos."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    _save_tokenizer(tokenizer, out, CHAT_TEMPLATE)
    cfg = _hf_config(tokenizer, tie_word_embeddings)
    cfg.save_pretrained(out)

    write_processor_files(out, tokenizer, "Qwen2_5_VLProcessor", patch_size=PATCH_SIZE,
                          min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, mean=CLIP_MEAN,
                          std=CLIP_STD)

    specials = (*SPECIAL_TOKENS, IMAGE_PAD, *QWEN_TOKENS)
    suppressed = _unprintable_ids(tokenizer, specials=specials) if printable_only else []
    sd = _text_state_dict(len(tokenizer), seed, tie=tie_word_embeddings, suppressed=suppressed)
    sd.update(_vision_state_dict(seed))
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
