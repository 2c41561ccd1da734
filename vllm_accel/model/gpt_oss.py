"""GPT-OSS: FMS's own model class (``fms.models.gpt_oss.GptOss``) loaded from HF
checkpoints of transformers' layout.

FMS 1.13.1 maps ``GptOssForCausalLM`` to its ``gpt_oss`` model, but its HF path
cannot load a transformers checkpoint into it correctly:

- its adapter reads only the MXFP4 release's packed experts
  (``gate_up_proj_blocks``/``_scales``); transformers' own checkpoints hold
  ``gate_up_proj`` [experts, hidden, 2 * intermediate] and ``down_proj``
  [experts, intermediate, hidden];
- it reorders the query/key rows for FMS's adjacent-pair rotary, taking a
  head as hidden / heads wide (45 for GPT-OSS's 2880 / 64, not its 64), while
  its YaRN rotary rotates each head's two halves, as HF's does: the rows must
  stay as they are;
- its param builder reads the rotary from fields HF's config lacks
  (``rope_base``, ``rope_scaling_factor``, ...), so FMS's defaults stand in;
- its YaRN takes the model's ``max_expected_seq_len`` (the 131,072 positions)
  as the pre-training length its correction range is computed from, where HF
  uses ``original_max_position_embeddings`` (4,096);
- its blocks size the experts' intermediate width as ``emb_dim`` (equal in
  the published configs) and hard-code a window of 128.

So ``FMS_PORT`` registers FMS's class, its rotary computed from the
pre-training length, under a name of its own, with a config built here from
HF's and an adapter for transformers' layout. The blocks are swapped for ones
the runner drives (``model/windowed_blocks.py``) and the experts'
forward is ``model/experts.py``'s (biases and the clamped SwiGLU included).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from fms.distributed.strategy import DistributedStrategy, NoOpStrategy
from fms.models import gpt_oss as fms_gpt_oss
from fms.models.gpt_oss import GptOssConfig

from vllm_accel.model.ports import LLAMA_LAYOUT_RENAMES, FmsPort, renamed

ARCHITECTURE = "gpt_oss_hf_transformers"
HF_ARCHITECTURE = "GptOssForCausalLM"
# The SwiGLU slope FMS's experts hard-code (ConditionalFeedForward.clamp_swiglu).
FMS_SWIGLU_ALPHA = 1.702


@dataclass
class GptOssHfConfig(GptOssConfig):
    # HF's rope_parameters["original_max_position_embeddings"]: the length
    # YaRN's correction range is computed from.
    rope_original_max_seq_len: int = 4096


class GptOss(fms_gpt_oss.GptOss):
    """FMS's GPT-OSS with its YaRN rotary computed from the pre-training
    length, as HF's."""

    def __init__(self, config: GptOssHfConfig | None = None,
                 distributed_strategy: DistributedStrategy = NoOpStrategy, **kwargs):
        super().__init__(config or GptOssHfConfig(), distributed_strategy, **kwargs)
        rotary = self.base_model.rot_emb
        rotary.rope_scaling.orig_max_seq_len = self.config.rope_original_max_seq_len
        # FMS filled its tables in __init__ from the wrong length: drop them;
        # post_init (after loading) computes them again.
        rotary.cached_freqs.clear()
        rotary.max_seq_len_cached.clear()


def gpt_oss_config_from_hf(hf_config) -> GptOssHfConfig:
    """FMS's GPT-OSS config for an HF one; fails naming what FMS's class
    cannot compute."""
    name = HF_ARCHITECTURE
    if hf_config.intermediate_size != hf_config.hidden_size:
        raise ValueError(f"{name}: intermediate_size {hf_config.intermediate_size} differs from "
                         f"hidden_size {hf_config.hidden_size}; FMS's GPT-OSS sizes its experts "
                         "as wide as the hidden state")
    if getattr(hf_config, "swiglu_alpha", FMS_SWIGLU_ALPHA) != FMS_SWIGLU_ALPHA:
        raise ValueError(f"{name}: swiglu_alpha {hf_config.swiglu_alpha}; FMS's experts compute "
                         f"{FMS_SWIGLU_ALPHA}")
    if not getattr(hf_config, "attention_bias", True):
        raise ValueError(f"{name}: attention_bias False; FMS's GPT-OSS attention has biases")
    if hf_config.tie_word_embeddings:
        raise ValueError(f"{name}: tie_word_embeddings; FMS's GPT-OSS has its own head")
    if getattr(hf_config, "quantization_config", None):
        raise ValueError(f"{name}: quantized checkpoints (MXFP4) are not supported; "
                         "serve a bfloat16 or float32 one")
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type") != "yarn" or rope.get("truncate", True):
        raise ValueError(f"{name}: rope {rope}; FMS's GPT-OSS computes YaRN with an "
                         "untruncated correction range (rope_type 'yarn', truncate False)")
    config = GptOssHfConfig(
        src_vocab_size=hf_config.vocab_size, emb_dim=hf_config.hidden_size,
        head_dim=hf_config.head_dim, nheads=hf_config.num_attention_heads,
        num_attention_heads=hf_config.num_attention_heads,
        kvheads=hf_config.num_key_value_heads, nlayers=hf_config.num_hidden_layers,
        num_experts=hf_config.num_local_experts,
        sliding_window=hf_config.sliding_window or 0, layer_types=list(hf_config.layer_types),
        rope_base=float(rope["rope_theta"]), rope_scaling_factor=float(rope["factor"]),
        rope_ntk_beta=float(rope.get("beta_fast") or 32.0),
        rope_ntk_alpha=float(rope.get("beta_slow") or 1.0),
        swiglu_limit=float(hf_config.swiglu_limit), norm_eps=hf_config.rms_norm_eps,
        p_dropout=0.0, rope_original_max_seq_len=int(rope["original_max_position_embeddings"]),
    )
    # Class attributes of FMS's config, not dataclass fields.
    config.top_k_experts = hf_config.num_experts_per_tok
    config.max_expected_seq_len = hf_config.max_position_embeddings
    return config


_RENAMES = LLAMA_LAYOUT_RENAMES + (
    (r"\.self_attn\.sinks$", ".attn.sinks"),
    (r"\.mlp\.router\.", ".ff_sub_layer.gate."),
    (r"\.mlp\.experts\.gate_up_proj_bias$", ".ff_sub_layer.cond_ffn.w13_bias"),
    (r"\.mlp\.experts\.down_proj_bias$", ".ff_sub_layer.cond_ffn.w2_bias"),
)
# transformers' [experts, in, out] -> FMS's [experts, out, in]
_EXPERTS = [
    (re.compile(r"\.mlp\.experts\.gate_up_proj$"), ".ff_sub_layer.cond_ffn.w13"),
    (re.compile(r"\.mlp\.experts\.down_proj$"), ".ff_sub_layer.cond_ffn.w2"),
]


def _hf_to_fms_names(sd: Mapping[str, Any], **_) -> dict:
    """transformers' keys -> FMS's: names, and the experts' matrices
    transposed to FMS's [experts, out, in] (gate and up rows stay
    interleaved, as FMS's clamped SwiGLU reads them). q/k/v are fused after
    this (``FmsPort.fused_prefix``)."""
    out = {}
    for name, tensor in sd.items():
        if name.endswith(("_blocks", "_scales")):
            raise ValueError(f"GPT-OSS checkpoint: {name} holds MXFP4-packed experts; "
                             "serve a bfloat16 or float32 checkpoint")
        name = renamed(name, _RENAMES)
        for pattern, repl in _EXPERTS:
            if pattern.search(name):
                name = pattern.sub(repl, name)
                tensor = tensor.transpose(1, 2).contiguous()
        out[name] = tensor
    return out


FMS_PORT = FmsPort(
    fms_architecture=ARCHITECTURE, hf_architecture=HF_ARCHITECTURE, model_class=GptOss,
    config_from_hf=gpt_oss_config_from_hf, hf_to_fms_names=_hf_to_fms_names,
    fused_prefix="base_model.layers.",
)

