"""MolmoE-1B: Molmo's vision side with an OLMoE decoder, FMS style.

The model is ``molmo.Molmo`` (the ViT, 2x2 attention pooling and projector
of Molmo-7B, our Qwen2 decoder) with its decoder configured as OLMoE's:
multi-head attention, RMSNorm over the whole q and k projections
(``attention_layer_norm``), RoPE in the rotate-half layout, and experts in
place of the MLP (``experts.RoutedFeedForward``): a softmax router over all
experts in float32, each token through its top k, the k weights kept as the
softmax gave them (OLMoE's ``norm_topk_prob=false``), each expert a SiLU-gated
MLP ``(mlp_hidden_size or mlp_ratio * d_model) / 2`` wide.

The hub's config.json uses OLMo's keys (``d_model``, ``n_heads``,
``n_layers``, ``moe_num_experts``, ``moe_top_k``, ...) under
``"architectures": ["OLMoForCausalLM"]`` and ``"model_type": "molmo"``, and
spells out the vision backbone (``vision_backbone``, ``vit_layers``).
``molmoe_config_from_hf`` refuses, naming the setting, every value of it this
port does not compute (published values pass).

Checkpoint layout. The decoder's names are Molmo's (``model.transformer.``:
``wte.embedding`` and ``wte.new_embedding``, ``blocks.N.att_proj`` (q, k, v
rows), ``attn_out``, ``q_norm``, ``k_norm``, ``attn_norm``, ``ff_norm``,
``ln_f``, ``ff_out`` the head); the experts' names and layout are those of
the MoE block of allenai's Molmo/OLMo training code (``OLMoEBlock``: ``self.ffn``
a megablocks dMoE) and of its conversion from HF's OLMoE:

    blocks.N.ffn.router.layer.weight  [experts, d_model]          the router
    blocks.N.ffn.experts.mlp.w1       [experts * ffn, d_model]    gate rows, expert after expert
    blocks.N.ffn.experts.mlp.v1       [experts * ffn, d_model]    up rows
    blocks.N.ffn.experts.mlp.w2       [experts * ffn, d_model]    down, transposed (x1 @ w2)

Not seen: the published checkpoint's own tensor index (no model hub here).
A checkpoint whose expert weights are named otherwise fails at load naming
the key and this layout.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch

from vllm_accel.model import molmo
from vllm_accel.model.molmo import (
    ADDITIONAL_VOCAB_SIZE,
    Molmo,
    MolmoConfig,
    MolmoVisionConfig,
)
from vllm_accel.model.ports import FmsPort
from vllm_accel.model.qwen2_layers import Qwen2Config

ARCHITECTURE = "molmoe"
HF_ARCHITECTURE = "OLMoForCausalLM"
_NAME = f"MolmoE ({HF_ARCHITECTURE})"

# Settings whose published MolmoE-1B-0924 values (the first allowed) are all
# the port computes, and what a config without the key means (OLMo's
# defaults: the hub's config class writes every key out).
_ONLY = (
    ("rope", (True,), False),
    ("alibi", (False,), False),
    ("rope_impl", ("llama",), "cockatoo"),  # "cockatoo": rotary on interleaved pairs
    ("layer_norm_type", ("rms",), "default"),
    ("layer_norm_with_affine", (True,), True),
    ("attention_layer_norm_with_affine", (True,), True),
    ("bias_for_layer_norm", (False, None), None),
    ("activation_type", ("swiglu",), "swiglu"),
    ("include_bias", (False,), True),
    ("qkv_bias", (False,), False),
    ("clip_qkv", (None,), None),
    ("multi_query_attention", (None, False), None),
    ("moe_shared_expert", (False,), False),
    ("moe_interleave", (False,), False),  # dense blocks between the MoE ones
    ("moe_dropless", (True,), True),  # else capacity-limited experts drop tokens
    ("weight_tying", (False,), True),
    ("scale_logits", (False,), False),
    ("normalize_input_embeds", (False,), False),
    ("attn_logit_softcapping", (None,), None),
    ("final_logit_softcapping", (None,), None),
    ("image_model_type", ("openai",), "openai"),  # in vision_backbone
    ("image_pooling_2d", ("attention-meanq",), "attention"),
    ("image_projector", ("mlp",), "mlp"),
    ("image_padding_embed", ("pad_and_partial_pad",), None),
    ("image_pooling_h", (2,), 2),
    ("image_pooling_w", (2,), 2),
    ("use_cls_feature", (False,), False),
)


def _refuse(setting: str, value, allowed) -> ValueError:
    return ValueError(f"vllm-accel cannot run {_NAME} with {setting}={value!r}: it computes "
                      f"{setting}={allowed!r} (MolmoE-1B-0924's) only")


def _vision_backbone(hf_config) -> dict:
    vb = getattr(hf_config, "vision_backbone", None)
    if getattr(hf_config, "block_type", None) != "moe" or vb is None:
        raise ValueError(
            f"vllm-accel serves {HF_ARCHITECTURE} as MolmoE-1B only (block_type 'moe' with a "
            f"vision_backbone); this config has block_type="
            f"{getattr(hf_config, 'block_type', None)!r} and "
            f"{'a' if vb is not None else 'no'} vision_backbone (a text OLMo checkpoint?)")
    return dict(vb) if isinstance(vb, Mapping) else dict(vars(vb))


def _check(hf_config, vb: dict) -> None:
    for setting, allowed, absent in _ONLY:
        value = (vb.get(setting, absent) if setting == "image_model_type"
                 else getattr(hf_config, setting, absent))
        if value not in allowed:
            raise _refuse(setting, value, allowed[0])
    heads = hf_config.n_heads
    kv_heads = getattr(hf_config, "n_kv_heads", None)
    if kv_heads not in (None, heads):
        # vLLM reads no n_kv_heads either: its KV cache would hold n_heads.
        raise _refuse("n_kv_heads", kv_heads, None)
    head_dim = getattr(hf_config, "head_dim", None)
    if head_dim not in (None, hf_config.d_model // heads):
        raise _refuse("head_dim", head_dim, None)
    vit_head_dim = vb.get("image_head_dim")
    if vit_head_dim is not None and vit_head_dim * vb["image_num_heads"] != vb["image_emb_dim"]:
        raise _refuse("vision_backbone.image_head_dim", vit_head_dim,
                      vb["image_emb_dim"] // vb["image_num_heads"])


def expert_width(hf_config) -> int:
    """One expert's inner width: OLMo's SwiGLU halves the MLP's hidden size."""
    hidden = getattr(hf_config, "mlp_hidden_size", None) or hf_config.mlp_ratio * hf_config.d_model
    return hidden // 2


def molmoe_config_from_hf(hf_config) -> MolmoConfig:
    """FMS config for a MolmoE config.json (OLMo keys); refuses what the port
    does not compute (``_ONLY``, grouped-query attention, a text OLMo)."""
    vb = _vision_backbone(hf_config)
    _check(hf_config, vb)
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise _refuse("rope_scaling", rope.get("rope_type"), None)
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10_000.0))
    text_vocab = hf_config.embedding_size or hf_config.vocab_size
    extra = getattr(hf_config, "additional_vocab_size", None) or ADDITIONAL_VOCAB_SIZE
    width = expert_width(hf_config)
    text = Qwen2Config(
        src_vocab_size=text_vocab + extra,
        head_vocab_size=text_vocab,
        emb_dim=hf_config.d_model,
        nheads=hf_config.n_heads,
        kvheads=hf_config.n_heads,
        nlayers=hf_config.n_layers,
        hidden_dim=width,
        norm_eps=getattr(hf_config, "layer_norm_eps", None) or 1e-5,
        rope_theta=float(theta),
        activation_fn="silu",
        max_expected_seq_len=(getattr(hf_config, "max_position_embeddings", None)
                              or hf_config.max_sequence_length),
        attn_bias=False,
        qk_norm=bool(getattr(hf_config, "attention_layer_norm", False)),
        norm_after=bool(getattr(hf_config, "norm_after", False)),
        num_experts=hf_config.moe_num_experts,
        top_k_experts=hf_config.moe_top_k,
        renormalize_experts=False,  # OLMoE's norm_topk_prob=false
    )
    # Molmo's reader of the vision dims (they have vLLM's field names here too).
    vision = MolmoVisionConfig.from_hf_config(SimpleNamespace(
        vision_backbone_config=vb, hidden_size=hf_config.d_model, intermediate_size=2 * width))
    vit_layers = tuple(getattr(hf_config, "vit_layers", None) or vision.vit_layers)
    return MolmoConfig(text_config=text, vision_config=vision.updated(vit_layers=vit_layers))


_FFN = re.compile(r"^model\.transformer\.blocks\.(\d+)\.ffn\.(.+)$")
_FFN_PARTS = ("router.layer.weight", "experts.mlp.w1", "experts.mlp.v1", "experts.mlp.w2")


def _hf_to_fms_names(sd: Mapping[str, Any], model_config: MolmoConfig | None = None,
                     **kwargs) -> dict:
    """Molmo's names for everything but the experts; each layer's experts
    into FMS's ``ff_sub_layer``: ``gate`` (the router), ``cond_ffn.w13``
    [experts, 2 * ffn, d_model] (gate rows, then up rows) and ``cond_ffn.w2``
    [experts, d_model, ffn]."""
    text = (model_config or MolmoConfig()).text_config
    rest, layers = {}, {}
    for name, tensor in sd.items():
        match = _FFN.match(name)
        if match is None:
            rest[name] = tensor
        elif match[2] in _FFN_PARTS:
            layers.setdefault(int(match[1]), {})[match[2]] = tensor
        else:
            raise ValueError(f"{_NAME} checkpoint weight {name!r}: expected the experts as "
                             f"ffn.{{{', '.join(_FFN_PARTS)}}} (megablocks' layout)")
    out = molmo._hf_to_fms_names(rest, model_config, **kwargs)
    for layer, parts in layers.items():
        missing = [f"ffn.{part}" for part in _FFN_PARTS if part not in parts]
        if missing:
            raise ValueError(f"{_NAME} checkpoint: block {layer} lacks {', '.join(missing)}")
        experts = text.num_experts or parts["router.layer.weight"].shape[0]
        gate, up, down = (parts[f"experts.mlp.{w}"].reshape(experts, -1, text.emb_dim)
                          for w in ("w1", "v1", "w2"))
        prefix = f"language_model.base_model.layers.{layer}.ff_sub_layer."
        out[prefix + "gate.weight"] = parts["router.layer.weight"]
        out[prefix + "cond_ffn.w13"] = torch.cat([gate, up], dim=1)
        out[prefix + "cond_ffn.w2"] = down.transpose(1, 2)
    return out


FMS_PORT = FmsPort(
    fms_architecture=ARCHITECTURE, hf_architecture=HF_ARCHITECTURE, model_class=Molmo,
    config_from_hf=molmoe_config_from_hf, hf_to_fms_names=_hf_to_fms_names,
    fused_prefix="language_model.", text_config_attr="text_config",
)
