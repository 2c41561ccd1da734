"""A tiny, deterministic, offline Qwen3-VL (dense) checkpoint for tests.

Made with transformers' own classes (``Qwen3VLConfig``,
``Qwen3VLForConditionalGeneration``, ``save_pretrained``: the hub's key
layout, ``model.language_model.*`` and ``model.visual.*``) and Qwen2.5-VL's
tiny tokenizer and ChatML template (tiny_qwen2_5_vl.py: the same special
tokens), with a Qwen2-VL image processor config for 16-pixel patches and
small pixel limits (4 to 64 image tokens of 32x32 pixels), a video
processor config (as the hub's), a processor config naming
``Qwen3VLProcessor`` and a generation config.

Shapes chosen to cover what Qwen3-VL adds: head_dim (128) apart from hidden /
heads (64), q/k norms per head, interleaved M-RoPE sections [24, 20, 20],
DeepStack features from vision blocks 0 and 2 into decoder layers 0 and 1 of
3, a learned 8x8 position table resampled to each image's grid.

Loads with transformers' ``Qwen3VLForConditionalGeneration`` and
``AutoProcessor`` without torchvision once ``vllm_accel.patches.apply_patches()``
has run (the stand-in video processor).

Usage:
    from vllm_accel.testing.tiny_qwen3_vl import make_tiny_qwen3_vl
    path = make_tiny_qwen3_vl(tmp_path / "tiny-qwen3_vl", seed=0)
"""

from __future__ import annotations

import os
import pathlib

import torch

from vllm_accel.testing.tiny_models import (
    SPECIAL_TOKENS,
    SUPPRESS_SCALE,
    WEIGHT_STD,
    _save_tokenizer,
    _unprintable_ids,
    fill_weights,
)
from vllm_accel.testing.tiny_qwen2_5_vl import (
    CHAT_TEMPLATE,
    IM_END,
    IMAGE_PAD,
    MERGE_SIZE,
    QWEN_TOKENS,
    TEMPORAL_PATCH_SIZE,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    _tokenizer,
    write_processor_files,
)

HIDDEN = 256
LAYERS = 3
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 128  # q is 512 wide, hidden 256 (as Qwen3-VL-4B: 32 x 128 over 2560)
INTERMEDIATE = 224
MROPE_SECTION = [24, 20, 20]  # HF's default; sums to HEAD_DIM / 2
ROPE_THETA = 5_000_000.0
MAX_POS = 4096

VISION_HIDDEN = 64
VISION_HEADS = 4  # head_dim 16
VISION_INTERMEDIATE = 128
VISION_DEPTH = 4
PATCH_SIZE = 16  # merged 2x2 over 2 frames, as Qwen2.5-VL's
NUM_POSITION_EMBEDDINGS = 64  # an 8x8 table
DEEPSTACK_INDEXES = [0, 2]
# Images are resized to between 4 and 64 merged tokens (32x32 pixels each).
MIN_PIXELS = 32 * 32 * 4
MAX_PIXELS = 32 * 32 * 64
IMAGE_MEAN = [0.5, 0.5, 0.5]
IMAGE_STD = [0.5, 0.5, 0.5]

PATCH_EMBED_STD = 0.03  # 1536 inputs per patch
MERGER_OUT_STD = 0.02  # image features enter the residual stream like embeddings


def _config(tokenizer, tie_word_embeddings: bool):
    from transformers import Qwen3VLConfig

    ids = tokenizer.convert_tokens_to_ids
    text = dict(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, max_position_embeddings=MAX_POS, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA,
                         "mrope_section": list(MROPE_SECTION), "mrope_interleaved": True},
        attention_bias=False, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None, eos_token_id=ids(IM_END), pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    vision = dict(
        depth=VISION_DEPTH, hidden_size=VISION_HIDDEN, intermediate_size=VISION_INTERMEDIATE,
        num_heads=VISION_HEADS, in_channels=3, patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE, spatial_merge_size=MERGE_SIZE,
        out_hidden_size=HIDDEN, num_position_embeddings=NUM_POSITION_EMBEDDINGS,
        deepstack_visual_indexes=list(DEEPSTACK_INDEXES), hidden_act="gelu_pytorch_tanh",
    )
    cfg = Qwen3VLConfig(
        text_config=text, vision_config=vision,
        image_token_id=ids(IMAGE_PAD), video_token_id=ids(VIDEO_PAD),
        vision_start_token_id=ids(VISION_START), vision_end_token_id=ids(VISION_END),
        tie_word_embeddings=tie_word_embeddings, dtype="float32",
    )
    cfg.architectures = ["Qwen3VLForConditionalGeneration"]
    return cfg


def _std(name: str) -> float:
    if name.endswith("patch_embed.proj.weight"):
        return PATCH_EMBED_STD
    if ("merger" in name) and name.endswith("linear_fc2.weight"):
        return MERGER_OUT_STD
    return WEIGHT_STD


def make_tiny_qwen3_vl(out_dir: str | os.PathLike, seed: int = 0, *,
                       tie_word_embeddings: bool = True,
                       printable_only: bool = True) -> pathlib.Path:
    """Write the checkpoint into ``out_dir`` and return it; the same bytes for
    the same arguments and library versions. ``printable_only``: the output
    rows of special and unprintable tokens are shrunk, so greedy output is
    printable text that never hits eos."""
    from transformers import Qwen3VLForConditionalGeneration

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    _save_tokenizer(tokenizer, out, CHAT_TEMPLATE)

    torch.manual_seed(seed)  # HF's own init draws from the global generator
    g = torch.Generator().manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(_config(tokenizer, tie_word_embeddings)).eval()
    with torch.no_grad():
        fill_weights(model, g, _std)
        if printable_only:
            specials = (*SPECIAL_TOKENS, IMAGE_PAD, *QWEN_TOKENS)
            model.lm_head.weight[_unprintable_ids(tokenizer, specials=specials)] *= SUPPRESS_SCALE
    model.save_pretrained(out)
    write_processor_files(out, tokenizer, "Qwen3VLProcessor", patch_size=PATCH_SIZE,
                          min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, mean=IMAGE_MEAN,
                          std=IMAGE_STD, video_processor_type="Qwen3VLVideoProcessor")
    return out
