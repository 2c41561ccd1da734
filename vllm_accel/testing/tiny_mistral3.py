"""A tiny, deterministic, offline Mistral3 checkpoint (Mistral-Small-3.1's
architecture: a Pixtral vision tower, a 2x2 patch merger and a Mistral text
model) for tests.

Made with transformers' own classes (``Mistral3Config`` over a
``MistralConfig`` and a ``PixtralVisionConfig``,
``Mistral3ForConditionalGeneration``, ``save_pretrained``), the byte-level
BPE tokenizer of tiny_models.py plus Pixtral's image tokens ``[IMG]`` (id 6),
``[IMG_BREAK]`` and ``[IMG_END]`` (appended after the BPE vocab), a Pixtral
image processor config with a small longest edge (images give at most 8x8
merged patches), a processor config and a Llama-3 style chat template that
renders an image part as ``[IMG]``. The processor expands each ``[IMG]`` to
rows of ``[IMG]`` closed by ``[IMG_BREAK]``, the last by ``[IMG_END]``.

``AutoProcessor.from_pretrained`` gives a ``PixtralProcessor``; without
torchvision only once ``vllm_accel.patches.apply_patches()`` has run (patches
1 and 17).

Usage:
    from vllm_accel.testing.tiny_mistral3 import make_tiny_mistral3
    path = make_tiny_mistral3(tmp_path / "tiny-mistral3", seed=0)
"""

from __future__ import annotations

import json
import os
import pathlib

import torch

from vllm_accel.testing.tiny_models import (
    SPECIAL_TOKENS,
    SUPPRESS_SCALE,
    _save_generation_config,
    _save_tokenizer,
    _unprintable_ids,
    build_tokenizer,
    fill_weights,
    vision_chat_template,
)

# Text model: GQA (4 query heads over 2 KV heads), head_dim 32, no window.
HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32  # vLLM's CPU attention (the benchmark peer) takes 32 and up
INTERMEDIATE = 256  # FMS rounds a Mistral MLP up to a multiple of 256 (multiple_of)
MAX_POS = 2048
ROPE_THETA = 1_000_000.0

# Vision tower: 8-pixel patches, merged 2x2 into one 16-pixel image token.
# Images are resized to fit a 128-pixel longest edge (rounded up to whole
# merged patches): at most 8x8 [IMG] tokens. The tower's image_size (its 2D
# RoPE covers image_size / patch_size patches a side) is the same 128.
VISION_HIDDEN = 32
VISION_LAYERS = 2
VISION_HEADS = 2  # head_dim 16
VISION_INTERMEDIATE = 64
PATCH_SIZE = 8
IMAGE_SIZE = 128
LONGEST_EDGE = 128
MERGE_SIZE = 2
VISION_ROPE_THETA = 10_000.0
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

IMG, IMG_BREAK, IMG_END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"

# An image part renders as [IMG] (Pixtral's processors expand it).
CHAT_TEMPLATE = vision_chat_template("[IMG]")


def _tokenizer():
    from tokenizers import AddedToken

    tokenizer = build_tokenizer(image_token=IMG, chat_template=CHAT_TEMPLATE)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False)
                          for t in (IMG_BREAK, IMG_END)], special_tokens=True)
    return tokenizer


def _config(tokenizer):
    from transformers import Mistral3Config, MistralConfig, PixtralVisionConfig

    text = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, max_position_embeddings=MAX_POS, sliding_window=None,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    vision = PixtralVisionConfig(
        hidden_size=VISION_HIDDEN, intermediate_size=VISION_INTERMEDIATE,
        num_hidden_layers=VISION_LAYERS, num_attention_heads=VISION_HEADS, num_channels=3,
        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE,
        hidden_act="silu",  # Mistral-Small-3.1's (the class default is gelu)
        rope_parameters={"rope_type": "default", "rope_theta": VISION_ROPE_THETA},
    )
    cfg = Mistral3Config(
        text_config=text, vision_config=vision,
        image_token_index=tokenizer.convert_tokens_to_ids(IMG),
        projector_hidden_act="gelu", vision_feature_layer=-1,
        multimodal_projector_bias=False, spatial_merge_size=MERGE_SIZE,
        tie_word_embeddings=False, dtype="float32",
    )
    cfg.architectures = ["Mistral3ForConditionalGeneration"]
    return cfg


def _write_json(path: pathlib.Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def make_tiny_mistral3(out_dir: str | os.PathLike, *, seed: int = 0,
                       printable_only: bool = True) -> pathlib.Path:
    """Write the checkpoint into ``out_dir`` and return it; the same bytes
    for the same seed and library versions. ``printable_only``: the lm_head
    rows of special (image tokens too) and unprintable tokens are shrunk, so
    greedy output is printable text that runs to max_tokens."""
    from transformers import Mistral3ForConditionalGeneration

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    _save_tokenizer(tokenizer, out, CHAT_TEMPLATE)

    torch.manual_seed(seed)  # HF's own init draws from the global generator
    g = torch.Generator().manual_seed(seed)
    model = Mistral3ForConditionalGeneration(_config(tokenizer)).eval()
    with torch.no_grad():
        fill_weights(model, g)
        if printable_only:
            specials = (*SPECIAL_TOKENS, IMG, IMG_BREAK, IMG_END)
            model.lm_head.weight[_unprintable_ids(tokenizer, specials=specials)] *= SUPPRESS_SCALE
    model.save_pretrained(out)
    _save_generation_config(tokenizer, out)

    # Legacy two-file processor layout, as on the hub for Mistral-Small-3.1.
    # "PixtralImageProcessor" resolves to PixtralImageProcessorPil without
    # torchvision. PixtralProcessor resizes to multiples of patch_size *
    # spatial_merge_size whatever patch_size says here.
    _write_json(out / "preprocessor_config.json", {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": CLIP_MEAN,
        "image_processor_type": "PixtralImageProcessor",
        "image_std": CLIP_STD,
        "patch_size": {"height": PATCH_SIZE, "width": PATCH_SIZE},
        "processor_class": "PixtralProcessor",
        "resample": 3,  # bicubic
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": LONGEST_EDGE},
    })
    _write_json(out / "processor_config.json", {
        "image_break_token": IMG_BREAK,
        "image_end_token": IMG_END,
        "image_token": IMG,
        "patch_size": PATCH_SIZE,
        "processor_class": "PixtralProcessor",
        "spatial_merge_size": MERGE_SIZE,
    })
    return out
