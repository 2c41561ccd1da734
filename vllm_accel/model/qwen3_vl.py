"""Qwen3-VL (dense) in IBM foundation-model-stack (FMS) style: composite
model, config and checkpoint mapping, FMS registration.

    Qwen3_VL
      language_model  Qwen2 (vllm_accel/model/qwen2.py) configured as Qwen3:
                      q/k RMSNorm per head, no q/k/v bias, head_dim apart
                      from hidden / heads, interleaved M-RoPE; takes wide
                      embeddings (DeepStack features added after its first
                      layers: ``qwen2.split_layer_additions``)
      visual          Qwen3VisionTransformer (vllm_accel/model/qwen3_vl_vision.py)

FMS 1.13's Qwen3 is a text model with 1-D rotary; it cannot take M-RoPE
positions or DeepStack features, so the decoder is our Qwen2 port's. Prompt
positions are Qwen2.5-VL's (``qwen2_5_vl.mrope_positions``: HF's
get_rope_index is the same for images). ``FMS_PORT`` tells FMS how to load
the hub checkpoint (registered by the loader, ``model/ports.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_accel.model.ports import FmsPort
from vllm_accel.model.qwen2 import qwen2_config_from_hf
from vllm_accel.model.qwen2_5_vl import (
    Qwen2_5_VL,
    Qwen2_5_VLConfig,
    qwen_vl_names,
    vision_token_ids,
)
from vllm_accel.model.qwen2_layers import Qwen2Config
from vllm_accel.model.qwen3_vl_vision import Qwen3VisionConfig, Qwen3VisionTransformer

ARCHITECTURE = "qwen3_vl"
HF_ARCHITECTURE = "Qwen3VLForConditionalGeneration"
# HF's text rotary (Qwen3VLTextRotaryEmbedding) defaults to these sections
# and always interleaves them, whatever rope_parameters' mrope_interleaved says.
DEFAULT_MROPE_SECTION = [24, 20, 20]


@dataclass
class Qwen3_VLConfig(Qwen2_5_VLConfig):
    # Defaults: Qwen3-VL-4B's shapes (token ids: Qwen2.5-VL's).
    text_config: Qwen2Config = field(default_factory=lambda: Qwen2Config(
        emb_dim=2560, nheads=32, kvheads=8, nlayers=36, hidden_dim=9728, head_size=128,
        mrope_section=list(DEFAULT_MROPE_SECTION), mrope_interleaved=True, attn_bias=False,
        qk_norm_per_head=True, tie_heads=True))
    vision_config: Qwen3VisionConfig = field(default_factory=Qwen3VisionConfig)


class Qwen3_VL(Qwen2_5_VL):
    """Qwen2.5-VL's composite with Qwen3-VL's config and tower: the caller
    runs ``visual`` on each image and writes its rows (embedding and
    DeepStack features) into the prompt's wide embeddings at the image-token
    positions."""

    config_class = Qwen3_VLConfig
    vision_class = Qwen3VisionTransformer


# ---------------------------------------------------------------------------
# HF config and checkpoint -> FMS
# ---------------------------------------------------------------------------


def qwen3_vl_config_from_hf(hf_config) -> Qwen3_VLConfig:
    t = hf_config.text_config
    text = qwen2_config_from_hf(t)
    rope = getattr(t, "rope_parameters", None) or {}
    text.mrope_section = list(rope.get("mrope_section") or DEFAULT_MROPE_SECTION)
    text.mrope_interleaved = True
    text.head_size = t.head_dim
    text.attn_bias = bool(t.attention_bias)
    text.qk_norm_per_head = True
    text.tie_heads = bool(hf_config.tie_word_embeddings)
    v = hf_config.vision_config
    vision_rope = getattr(v, "rope_parameters", None) or {}
    vision = Qwen3VisionConfig(
        depth=v.depth, emb_dim=v.hidden_size, nheads=v.num_heads, hidden_dim=v.intermediate_size,
        in_channels=v.in_channels, patch_size=v.patch_size,
        temporal_patch_size=v.temporal_patch_size, spatial_merge_size=v.spatial_merge_size,
        num_position_embeddings=v.num_position_embeddings,
        deepstack_indexes=list(v.deepstack_visual_indexes), out_dim=v.out_hidden_size,
        rope_theta=float(vision_rope.get("rope_theta", 10_000.0)), activation_fn=v.hidden_act,
    )
    if len(vision.deepstack_indexes) > text.nlayers:
        raise ValueError(f"Qwen3-VL: {len(vision.deepstack_indexes)} DeepStack features for "
                         f"{text.nlayers} decoder layers")
    return Qwen3_VLConfig(text_config=text, vision_config=vision, **vision_token_ids(hf_config))


_VISION_RENAMES = (
    (r"^visual\.blocks\.", "visual.layers."),
    (r"\.norm1\.", ".ln."),
    (r"\.norm2\.", ".ff_ln."),
    (r"\.attn\.proj\.", ".attn.dense."),
    (r"\.mlp\.linear_fc1\.", ".mlp.fc1."),
    (r"\.mlp\.linear_fc2\.", ".mlp.fc2."),
    (r"^visual\.patch_embed\.proj\.", "visual.patch_embed."),
    (r"^visual\.deepstack_merger_list\.", "visual.deepstack_mergers."),
    (r"^(visual\.(merger|deepstack_mergers\.\d+))\.norm\.", r"\1.ln."),
    (r"^(visual\.(merger|deepstack_mergers\.\d+))\.linear_fc1\.", r"\1.fc1."),
    (r"^(visual\.(merger|deepstack_mergers\.\d+))\.linear_fc2\.", r"\1.fc2."),
)


FMS_PORT = FmsPort(
    fms_architecture=ARCHITECTURE, hf_architecture=HF_ARCHITECTURE, model_class=Qwen3_VL,
    config_from_hf=qwen3_vl_config_from_hf, hf_to_fms_names=qwen_vl_names(_VISION_RENAMES),
    fused_prefix="language_model.", text_config_attr="text_config",
)
