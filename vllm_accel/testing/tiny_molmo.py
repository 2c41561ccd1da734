"""Deterministic, offline generator of a tiny random-weight Molmo checkpoint.

Molmo is not in transformers: on the hub it ships remote code whose
processing needs torchvision. The fixture carries its own torchvision-free
remote code (``molmo_remote_code/``: config, image processor, processor,
loaded with ``trust_remote_code=True``) implementing the interface vLLM's
Molmo processing calls, and a config.json / model.safetensors in the hub
layout of Molmo-7B-D-0924 (``decoder="qwen2"``) or Molmo-7B-O-0924
(``decoder="olmo"``), with tiny shapes.

Vision backbone: vLLM's MolmoForCausalLM hard-codes the full-size one
(``VisionBackboneConfig()``: 336 px crops of 14 px patches, width 1024, 23
layers, ~300M parameters). This fixture uses a small one (48 px crops of 4 px
patches, width 64, 9 layers: the fewest that still have the hard-coded
feature layers [-2, -9]) and records its dimensions under
``vision_backbone_config`` in config.json, with vLLM's VisionBackboneConfig
field names. Real checkpoints have no such entry; readers fall back to the
full-size defaults. To build vLLM's class on this fixture, a test patches
VisionBackboneConfig's defaults with these values.

Vocabulary, as Molmo lays it out: text tokens (the byte-level BPE of
tiny_models plus ``<|endoftext|>``, Qwen2's bos/eos/pad), padding tokens up to
``embedding_size`` (rows of ``wte.embedding`` and of the untied head), then
the image tokens in the first rows of ``wte.new_embedding`` (128 rows), so the
head can never emit them.

Usage:
    from vllm_accel.testing.tiny_molmo import make_tiny_molmo
    path = make_tiny_molmo(tmp_path / "tiny-molmo", seed=0)

    python -m vllm_accel.testing.tiny_molmo /tmp/tiny-molmo --decoder olmo
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil

import torch
from safetensors.torch import save_file

from vllm_accel.testing.tiny_models import (
    BIAS_STD,
    NORM_NOISE,
    SUPPRESS_SCALE,
    WEIGHT_STD,
    _save_tokenizer,
    _unprintable_ids,
    _write_json,
    build_tokenizer,
)

DECODERS = ("qwen2", "olmo")
REMOTE_CODE_DIR = pathlib.Path(__file__).with_name("molmo_remote_code")
REMOTE_CODE_FILES = ("config_molmo.py", "image_preprocessing_molmo.py", "preprocessing_molmo.py")

# Text decoder: Molmo's intermediate_size is the fused (up, gate) width.
HIDDEN = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2  # qwen2 variant; the olmo variant is multi-head, as Molmo-7B-O
HEAD_DIM = HIDDEN // HEADS  # 64: vLLM derives it from hidden_size / heads
INTERMEDIATE = 1024  # ff_proj rows; ff_out and the projector use 512
MAX_POS = 4096

# Vocabulary (see module docstring).
ENDOFTEXT = "<|endoftext|>"
IMAGE_TOKENS = ("<im_start>", "<im_end>", "<im_patch>", "<im_col>", "<|image|>")
EMBEDDING_SIZE = 392  # 384 BPE tokens + <|endoftext|> + 7 padding tokens
ADDITIONAL_VOCAB = 128  # rows of wte.new_embedding (vLLM: ADDITIONAL_VOCAB_SIZE)

# Small vision backbone, in vLLM's VisionBackboneConfig field names.
VISION_BACKBONE = {
    "image_default_input_size": [48, 48],
    "image_patch_size": 4,
    "image_pos_patch_size": 4,
    "image_emb_dim": 64,
    "image_num_heads": 4,
    "image_num_key_value_heads": 4,
    "image_num_layers": 9,
    "image_mlp_dim": 128,
    "image_mlp_activations": "quick_gelu",
    "image_num_pos": (48 // 4) ** 2 + 1,  # patches + class token
    "image_norm_eps": 1e-5,
}
VIT_LAYERS = (-2, -9)  # hard-coded in Molmo (and vLLM): features concatenated
# Image processor: same structure as the hub's (12 crops of 336 px, margins
# (4, 4) patches of 14 px, 12 x 12 tokens per crop), scaled to the small ViT.
MAX_CROPS = 6
OVERLAP_MARGINS = [2, 2]
CROP_TOKENS = (48 // 4 + 1) // 2  # 6 x 6 pooled tokens per crop

# vision="full": the hub's backbone and image processor (vLLM's
# VisionBackboneConfig defaults; ~290M parameters, ~1.2 GB of float32), for
# benchmarks against vLLM's Molmo, which can only build this one. Written
# without a vision_backbone_config entry, as real checkpoints are.
FULL_VISION_BACKBONE = {
    "image_default_input_size": [336, 336],
    "image_patch_size": 14,
    "image_pos_patch_size": 14,
    "image_emb_dim": 1024,
    "image_num_heads": 16,
    "image_num_key_value_heads": 16,
    "image_num_layers": 23,
    "image_mlp_dim": 4096,
    "image_mlp_activations": "quick_gelu",
    "image_num_pos": (336 // 14) ** 2 + 1,
    "image_norm_eps": 1e-5,
}
# (backbone, max_crops, overlap_margins, pooled tokens per crop side) per size.
VISION_SIZES = {
    "small": (VISION_BACKBONE, MAX_CROPS, OVERLAP_MARGINS, CROP_TOKENS),
    "full": (FULL_VISION_BACKBONE, 12, [4, 4], (336 // 14 + 1) // 2),
}
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
VISION_SEED_OFFSET = 1_000_003
# The projector output replaces token embeddings (std WEIGHT_STD = 0.1); with
# these weights image embeddings come out at std ~0.1 too (0.05 gave ~0.9).
PROJECTOR_STD = (0.1, 0.1, 0.005)  # w1 (gate), w3 (up), w2 (down)

# Molmo's own prompt format ("User: ... Assistant:"), as the hub's tokenizer
# config renders it. Content may be a string or an OpenAI-style list of parts:
# text parts are joined, image parts render nothing (the processor puts the
# image tokens at the start of the prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if not loop.first %}{{ ' ' }}{% endif %}"
    "{{ message['role'] | capitalize }}{{ ': ' }}"
    "{% if message['content'] is string %}"
    "{{ message['content'] | trim }}"
    "{% else %}"
    "{{ message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | map('trim') | join(' ') }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ ' Assistant:' }}{% endif %}"
)


def build_molmo_tokenizer():
    """The tiny BPE tokenizer with Molmo's vocabulary layout: no bos is added
    (like Qwen2/OLMo), ``<|endoftext|>`` is eos and pad, image tokens start at
    EMBEDDING_SIZE."""
    from tokenizers import AddedToken, processors

    tok = build_tokenizer(chat_template=CHAT_TEMPLATE)
    tok.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    padding = [f"|<EXTRA_TOKENS_{i}>|" for i in range(EMBEDDING_SIZE - len(tok) - 1)]
    for text in (ENDOFTEXT, *padding, *IMAGE_TOKENS):
        tok.add_tokens([AddedToken(text, special=True, normalized=False)], special_tokens=True)
    tok.bos_token = None
    tok.eos_token = ENDOFTEXT
    tok.pad_token = ENDOFTEXT
    ids = tok.convert_tokens_to_ids(list(IMAGE_TOKENS))
    if ids != list(range(EMBEDDING_SIZE, EMBEDDING_SIZE + len(IMAGE_TOKENS))):
        raise RuntimeError(f"image tokens at ids {ids}, expected from {EMBEDDING_SIZE}")
    return tok


def _config(decoder: str, tokenizer, vision: str) -> dict:
    eos = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    cfg = {
        "architectures": ["MolmoForCausalLM"],
        # No modeling code ships with the fixture: only the config is remote code.
        "auto_map": {"AutoConfig": "config_molmo.MolmoConfig"},
        "model_type": "molmo",
        "clip_qkv": None,
        "embedding_size": EMBEDDING_SIZE,
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE,
        "layer_norm_eps": 1e-6,
        "layer_norm_type": "rms",
        "max_position_embeddings": MAX_POS,
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_position_ids": True,
        "weight_tying": False,
        "eos_token_id": eos,
        "pad_token_id": eos,
    }
    if vision == "small":
        cfg["vision_backbone_config"] = dict(VISION_BACKBONE)
    if decoder == "qwen2":  # Molmo-7B-D-0924: Qwen2-7B
        cfg.update(attention_layer_norm=False, norm_after=False, num_key_value_heads=KV_HEADS,
                   qkv_bias=True, rope_theta=1000000.0, vocab_size=EMBEDDING_SIZE)
    else:  # Molmo-7B-O-0924: OLMo-7B-1024 (q/k norm, norms after attn/MLP, MHA)
        # "num_key_value_heads": null as published (multi-head attention);
        # vLLM 0.33 needs patches.py's patch 10 to read it.
        cfg.update(attention_layer_norm=True, norm_after=True, num_key_value_heads=None,
                   qkv_bias=False, rope_theta=500000.0,
                   vocab_size=eos + 1)  # text tokens only (< embedding_size), as in 7B-O
    return cfg


def _text_state_dict(cfg: dict, seed: int, suppressed: list[int]) -> dict[str, torch.Tensor]:
    """Decoder weights in the hub's key layout, drawn in a fixed order."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, std=WEIGHT_STD):
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std

    def norm(dim=HIDDEN):
        return 1.0 + NORM_NOISE * torch.randn(dim, generator=g, dtype=torch.float32)

    kv = cfg["num_key_value_heads"] or HEADS
    qkv_rows = (HEADS + 2 * kv) * HEAD_DIM
    t = "model.transformer."
    sd = {t + "wte.embedding": normal(EMBEDDING_SIZE, HIDDEN),
          t + "wte.new_embedding": normal(ADDITIONAL_VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"{t}blocks.{i}."
        sd[p + "att_proj.weight"] = normal(qkv_rows, HIDDEN)
        if cfg["qkv_bias"]:
            sd[p + "att_proj.bias"] = normal(qkv_rows, std=BIAS_STD)
        if cfg["attention_layer_norm"]:
            sd[p + "q_norm.weight"] = norm(HEADS * HEAD_DIM)
            sd[p + "k_norm.weight"] = norm(kv * HEAD_DIM)
        sd[p + "attn_out.weight"] = normal(HIDDEN, HEADS * HEAD_DIM)
        sd[p + "attn_norm.weight"] = norm()
        sd[p + "ff_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        sd[p + "ff_out.weight"] = normal(HIDDEN, INTERMEDIATE // 2)
        sd[p + "ff_norm.weight"] = norm()
    sd[t + "ln_f.weight"] = norm()
    head = normal(EMBEDDING_SIZE, HIDDEN)
    head[suppressed] *= SUPPRESS_SCALE
    sd[t + "ff_out.weight"] = head
    return sd


def _vision_state_dict(seed: int, vision: str, text_dim: int = HIDDEN,
                       projector_dim: int = INTERMEDIATE // 2,
                       vb: dict | None = None) -> dict[str, torch.Tensor]:
    """model.vision_backbone.* (ViT, 2x2 attention pooling, projector into
    ``text_dim`` through ``projector_dim``, pad_embed) in the hub's key
    layout, with their own generator; ``vb``: the backbone (default: the
    size's)."""
    g = torch.Generator().manual_seed(seed + VISION_SEED_OFFSET)
    vb = vb or VISION_SIZES[vision][0]
    width, mlp = vb["image_emb_dim"], vb["image_mlp_dim"]
    pixels = vb["image_patch_size"] ** 2 * 3
    # Wider layers get smaller weights, so activations keep the small ViT's scale.
    scale = (VISION_BACKBONE["image_emb_dim"] / width) ** 0.5

    def normal(*shape, std=WEIGHT_STD):
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std * scale

    def linear(sd, name, out_dim, in_dim, bias=True, std=WEIGHT_STD):
        sd[name + ".weight"] = normal(out_dim, in_dim, std=std)
        if bias:
            sd[name + ".bias"] = normal(out_dim, std=BIAS_STD)

    def layer_norm(sd, name):
        sd[name + ".weight"] = 1.0 + NORM_NOISE * torch.randn(width, generator=g)
        sd[name + ".bias"] = normal(width, std=BIAS_STD)

    v = "model.vision_backbone."
    sd: dict[str, torch.Tensor] = {}
    sd[v + "image_vit.class_embedding"] = normal(width)
    sd[v + "image_vit.positional_embedding"] = normal(vb["image_num_pos"], width)
    linear(sd, v + "image_vit.patch_embedding", width, pixels, bias=False)
    layer_norm(sd, v + "image_vit.pre_ln")
    for i in range(vb["image_num_layers"]):
        p = f"{v}image_vit.transformer.resblocks.{i}."
        for proj in ("wq", "wk", "wv", "wo"):
            linear(sd, p + "attention." + proj, width, width)
        linear(sd, p + "feed_forward.w1", mlp, width)
        linear(sd, p + "feed_forward.w2", width, mlp)
        layer_norm(sd, p + "attention_norm")
        layer_norm(sd, p + "ffn_norm")
    features = width * len(VIT_LAYERS)
    for proj in ("wq", "wk", "wv"):
        linear(sd, v + "image_pooling_2d." + proj, width, features)
    linear(sd, v + "image_pooling_2d.wo", width, width)
    gate_std, up_std, down_std = PROJECTOR_STD
    linear(sd, v + "image_projector.w1", projector_dim, width, bias=False, std=gate_std)
    linear(sd, v + "image_projector.w3", projector_dim, width, bias=False, std=up_std)
    linear(sd, v + "image_projector.w2", text_dim, projector_dim, bias=False, std=down_std)
    sd[v + "pad_embed"] = normal(2, features)
    return sd


def _processor_files(out: pathlib.Path, vision: str) -> None:
    vb, max_crops, margins, crop_tokens = VISION_SIZES[vision]
    _write_json(out / "preprocessor_config.json", {
        "auto_map": {
            "AutoImageProcessor": "image_preprocessing_molmo.MolmoImageProcessor",
            "AutoProcessor": "preprocessing_molmo.MolmoProcessor",
        },
        "base_image_input_size": list(vb["image_default_input_size"]),
        "do_normalize": True,
        "image_mean": CLIP_MEAN,
        "image_padding_mask": True,
        "image_patch_size": vb["image_patch_size"],
        "image_processor_type": "MolmoImageProcessor",
        "image_std": CLIP_STD,
        "image_token_length_h": crop_tokens,
        "image_token_length_w": crop_tokens,
        "max_crops": max_crops,
        "overlap_margins": margins,
        "processor_class": "MolmoProcessor",
    })
    _write_json(out / "processor_config.json", {
        "auto_map": {"AutoProcessor": "preprocessing_molmo.MolmoProcessor"},
        "processor_class": "MolmoProcessor",
    })
    for name in REMOTE_CODE_FILES:
        shutil.copyfile(REMOTE_CODE_DIR / name, out / name)


def suppressed_ids(tokenizer) -> list[int]:
    """Head rows to shrink: special, padding and non-printable byte tokens."""
    eos = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    specials = (ENDOFTEXT, *IMAGE_TOKENS, *tokenizer.all_special_tokens,
                *(tokenizer.convert_ids_to_tokens(i) for i in range(eos + 1, EMBEDDING_SIZE)))
    return [i for i in _unprintable_ids(tokenizer, specials=tuple(specials)) if i < EMBEDDING_SIZE]


def start_checkpoint(out_dir: str | os.PathLike, vision: str):
    """(directory, tokenizer): ``out_dir`` made, with what Molmo and MolmoE
    checkpoints share written into it: the tokenizer, the generation config
    and the processor's files for ``vision``."""
    if vision not in VISION_SIZES:
        raise ValueError(f"unsupported vision {vision!r}; choose from {list(VISION_SIZES)}")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_molmo_tokenizer()
    _save_tokenizer(tokenizer, out, CHAT_TEMPLATE)
    eos = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    _write_json(out / "generation_config.json", {
        "eos_token_id": eos, "pad_token_id": eos, "bos_token_id": None,
    })
    _processor_files(out, vision)
    return out, tokenizer


def make_tiny_molmo(
    out_dir: str | os.PathLike, seed: int = 0, decoder: str = "qwen2",
    *, printable_only: bool = True, vision: str = "small",
) -> pathlib.Path:
    """Write a complete tiny Molmo checkpoint into ``out_dir`` and return it.

    Byte-for-byte identical for the same (seed, decoder, vision) and library
    versions. ``printable_only`` shrinks the head rows of special, padding and
    non-printable byte tokens, as tiny_models.make_tiny_checkpoint does.
    ``vision``: "small" (the tests' backbone) or "full" (the hub's).
    """
    if decoder not in DECODERS:
        raise ValueError(f"unsupported decoder {decoder!r}; choose from {DECODERS}")
    out, tokenizer = start_checkpoint(out_dir, vision)
    cfg = _config(decoder, tokenizer, vision)
    _write_json(out / "config.json", cfg)
    sd = _text_state_dict(cfg, seed, suppressed_ids(tokenizer) if printable_only else [])
    sd.update(_vision_state_dict(seed, vision))
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decoder", choices=DECODERS, default="qwen2")
    parser.add_argument("--vision", choices=list(VISION_SIZES), default="small")
    args = parser.parse_args(argv)
    print(make_tiny_molmo(args.out_dir, seed=args.seed, decoder=args.decoder,
                          vision=args.vision))


if __name__ == "__main__":
    main()
