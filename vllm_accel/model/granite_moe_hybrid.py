"""Granite 4 (GraniteMoeHybridForCausalLM) in FMS style: Mamba2 and attention
layers, Granite's multipliers.

FMS 1.13 maps GraniteMoeHybridForCausalLM to its Granite (``fms/models/
granite_moe_hybrid.py``): attention in every layer, so only the all-attention
dense checkpoints load. This port is FMS's Granite (embedding multiplier,
attention with ``attention_multiplier`` as its scale, residual multiplier,
logits scaling, the shared SwiGLU MLP as FMS's gated linear unit) with the
layers HF's config names Mamba2 (``layer_types``) swapped for ``Mamba2Block``s
over vLLM's paged recurrent state (model/mamba2.py); attention runs without a
rotary embedding where ``position_embedding_type`` is not "rope" (granite-4.0-h).

With experts (``num_local_experts`` > 0) each layer's MLP is the experts'
output plus the shared MLP's, as in HF's ``GraniteMoeHybridDecoderLayer``:
the experts are FMS's ``MOEFeedForward`` (its router picks the top-k logits,
then a softmax over them: ``topk_first``), which the loader replaces by
``model/experts.py``; dense checkpoints (``num_local_experts`` 0) have the
shared MLP alone.

    GraniteMoeHybrid
      base_model: FMS GraniteHeadless
        layers   GraniteBlock (attention) or Mamba2Block (ln, mixer, ff_ln, ff_sub_layer)
                 ff_sub_layer: the shared MLP (FMS's GatedLinearUnit), or
                 SharedMLPAndExperts(shared, moe)
      head
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from fms.distributed.strategy import DistributedStrategy, NoOpStrategy
from fms.models.granite import Granite, GraniteConfig
from fms.modules.feedforward import MOEFeedForward
from fms.modules.ssm import SSM
from torch import nn

from vllm_accel.model.mamba2 import Mamba2Block, PagedMamba2
from vllm_accel.model.ports import LLAMA_LAYOUT_RENAMES, FmsPort, renamed

ARCHITECTURE = "vllm_accel_granite_moe_hybrid"
HF_ARCHITECTURE = "GraniteMoeHybridForCausalLM"
_MAMBA_KINDS = ("mamba", "linear_attention")


@dataclass
class GraniteMoeHybridConfig(GraniteConfig):
    # Per layer: True where it is a Mamba2 layer (HF's layer_types "mamba"
    # or "linear_attention"), else attention.
    mamba_layers: list[bool] = field(default_factory=list)
    rope: bool = False  # HF's position_embedding_type == "rope"
    mamba_n_heads: int = 128
    mamba_d_head: int = 64
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_conv: int = 4
    mamba_expand: float = 2.0
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    num_experts: int = 0  # 0: dense, the shared MLP alone
    experts_top_k: int = 2
    experts_intermediate: int = 1024


def config_from_hf(hf) -> GraniteMoeHybridConfig:
    from vllm_accel.architectures import _rope_theta

    rope = getattr(hf, "position_embedding_type", None) == "rope"
    return GraniteMoeHybridConfig(
        src_vocab_size=hf.vocab_size, emb_dim=hf.hidden_size, norm_eps=hf.rms_norm_eps,
        nheads=hf.num_attention_heads, kvheads=hf.num_key_value_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        nlayers=hf.num_hidden_layers,
        # The shared MLP's width (the experts' is intermediate_size).
        hidden_grow_factor=hf.shared_intermediate_size / hf.hidden_size, multiple_of=1,
        activation_fn=hf.hidden_act, max_expected_seq_len=hf.max_position_embeddings,
        attn_bias=hf.attention_bias, tie_heads=hf.tie_word_embeddings,
        rope_theta=_rope_theta(hf) if rope else 10_000.0,
        embedding_multiplier=hf.embedding_multiplier, logits_scaling=hf.logits_scaling,
        residual_multiplier=hf.residual_multiplier,
        attention_multiplier=hf.attention_multiplier, fused_weights=True,
        mamba_layers=[kind in _MAMBA_KINDS for kind in hf.layer_types], rope=rope,
        mamba_n_heads=hf.mamba_n_heads, mamba_d_head=hf.mamba_d_head,
        mamba_n_groups=hf.mamba_n_groups, mamba_d_state=hf.mamba_d_state,
        mamba_d_conv=hf.mamba_d_conv, mamba_expand=hf.mamba_expand,
        mamba_chunk_size=hf.mamba_chunk_size, mamba_conv_bias=hf.mamba_conv_bias,
        mamba_proj_bias=hf.mamba_proj_bias, num_experts=hf.num_local_experts or 0,
        experts_top_k=hf.num_experts_per_tok, experts_intermediate=hf.intermediate_size)


class SharedMLPAndExperts(nn.Module):
    """A layer's MLP with experts: the experts' output plus the shared MLP's."""

    def __init__(self, shared: nn.Module, moe: nn.Module):
        super().__init__()
        self.shared, self.moe = shared, moe

    def forward(self, x):
        return self.moe(x) + self.shared(x)


class GraniteMoeHybrid(Granite):
    def __init__(self, config: GraniteMoeHybridConfig | None = None,
                 distributed_strategy: DistributedStrategy = NoOpStrategy, **kwargs):
        super().__init__(config or GraniteMoeHybridConfig(), distributed_strategy, **kwargs)
        c = self.config
        layers = self.base_model.layers
        for index, is_mamba in enumerate(c.mamba_layers):
            block = layers[index]
            if is_mamba:
                ssm = SSM(c.mamba_n_heads, c.emb_dim, c.mamba_d_state, c.mamba_d_conv,
                          c.mamba_expand, c.mamba_proj_bias, c.mamba_conv_bias,
                          c.activation_fn, c.norm_eps, c.mamba_n_groups, c.mamba_d_head,
                          c.mamba_chunk_size)
                block = layers[index] = Mamba2Block(block.ln, PagedMamba2(ssm), block.ff_ln,
                                                    block.ff_sub_layer, c.residual_multiplier)
            elif not c.rope:  # no position encoding (granite-4.0-h)
                block.attn.position_encoder = None
            if c.num_experts:
                block.ff_sub_layer = SharedMLPAndExperts(block.ff_sub_layer, MOEFeedForward(
                    c.num_experts, c.experts_top_k, c.emb_dim, c.experts_intermediate,
                    topk_first=True))


_RENAMES = LLAMA_LAYOUT_RENAMES + (
    (r"\.mamba\.", ".mixer."),
    # The experts: the router, then each expert's [gate; up] and down stacked.
    (r"\.block_sparse_moe\.router\.layer\.", ".ff_sub_layer.moe.gate."),
    (r"\.block_sparse_moe\.input_linear\.weight", ".ff_sub_layer.moe.cond_ffn.w13"),
    (r"\.block_sparse_moe\.output_linear\.weight", ".ff_sub_layer.moe.cond_ffn.w2"),
)
_ROTATED = re.compile(r"base_model\.layers\.\d+\.attn\.in_proj\.(query|key)\.(weight|bias)$")


def _hf_to_fms_names(sd: Mapping[str, Any], model_config=None, **_) -> dict:
    """HF names -> ours: the shared MLP's input ([gate; up], the layout of
    FMS's fused ``wg1_fused``) and output under the layer's ``ff_sub_layer``
    (its ``shared`` part where the layer has experts); with a rotary
    embedding, each head's query and key rows from HF's rotate-half pairs
    (i, i + d/2) to FMS's adjacent ones."""
    shared = "ff_sub_layer.shared" if model_config is not None and model_config.num_experts \
        else "ff_sub_layer"
    out = {}
    for name, tensor in sd.items():
        name = renamed(name, _RENAMES)
        name = name.replace("shared_mlp.input_linear", f"{shared}.wg1_fused")
        name = name.replace("shared_mlp.output_linear", f"{shared}.w2")
        if model_config is not None and model_config.rope and _ROTATED.search(name):
            head = model_config.head_dim
            rows = tensor.view(-1, 2, head // 2, *tensor.shape[1:])
            tensor = rows.transpose(1, 2).reshape(tensor.shape)
        out[name] = tensor
    return out


FMS_PORT = FmsPort(
    fms_architecture=ARCHITECTURE, hf_architecture=HF_ARCHITECTURE, model_class=GraniteMoeHybrid,
    config_from_hf=config_from_hf, hf_to_fms_names=_hf_to_fms_names,
    fused_prefix="base_model.",
)
