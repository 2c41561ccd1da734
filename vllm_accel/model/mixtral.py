"""Mixtral: FMS's own model class (``fms.models.mixtral.Mixtral``) loaded from
HF hub checkpoints.

FMS 1.13.1 maps ``MixtralForCausalLM`` to its ``mixtral`` model but cannot
load a hub checkpoint into it:

- its HF param builder (``build_mixtral_params``) passes the KV head count
  as ``kv_heads``, which ``MixtralConfig`` does not have: ``kvheads`` keeps
  its default 8 (Mixtral-8x7B's, by coincidence; any other count fails an
  assertion or attends wrongly);
- its ``"hf"`` adapter reads Mistral's original release layout
  (``layers.N.attention.wq``, ``block_sparse_moe.w1`` stacked over experts),
  not the hub's (``model.layers.N.self_attn.q_proj``,
  ``block_sparse_moe.experts.E.w1``).

Under tensor parallelism FMS's Mixtral also shards its LM head over the
vocabulary; the runner computes logits on the driver rank alone, which needs
the head whole there (FMS's LLaMA keeps it whole).

So ``FMS_PORT`` registers FMS's class (its head kept whole) under a name of
its own, with a config built here and the hub layout's adapter; registering
it (``model/ports.py``, in the process that loads a Mixtral checkpoint) points
FMS's HF mapping of ``MixtralForCausalLM`` at it. The experts' forward is not
FMS's either: ``model/experts.py`` replaces each MoE layer at load.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch
from fms.distributed.strategy import DistributedStrategy, NoOpStrategy
from fms.models import mixtral as fms_mixtral
from fms.models.mixtral import MixtralConfig
from fms.modules.head import LinearClassificationHead

from vllm_accel.model.ports import LLAMA_LAYOUT_RENAMES, FmsPort, renamed

ARCHITECTURE = "mixtral_hf_hub"
HF_ARCHITECTURE = "MixtralForCausalLM"


class Mixtral(fms_mixtral.Mixtral):
    """FMS's Mixtral with its LM head whole on every rank (FMS's strategy
    still shards the decoder's attention and experts)."""

    def __init__(self, config: MixtralConfig | None = None,
                 distributed_strategy: DistributedStrategy = NoOpStrategy, **kwargs):
        super().__init__(config, distributed_strategy, **kwargs)
        self.head = LinearClassificationHead(self.config.dim, self.config.src_vocab_size,
                                             bias=False)


def mixtral_config_from_hf(hf_config) -> MixtralConfig:
    """FMS's Mixtral config for an HF one; fails naming what FMS's class
    cannot compute."""
    heads, hidden = hf_config.num_attention_heads, hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    if head_dim * heads != hidden:
        raise ValueError(f"Mixtral: head_dim {head_dim} x {heads} heads is not hidden_size "
                         f"{hidden}; FMS's Mixtral computes heads of hidden_size / heads")
    if hf_config.hidden_act != "silu":
        raise ValueError(f"Mixtral: hidden_act {hf_config.hidden_act!r}; FMS's experts run SiLU")
    if hf_config.tie_word_embeddings:
        raise ValueError("Mixtral: tie_word_embeddings; FMS's Mixtral has its own head")
    # transformers 5 folds rope_theta/rope_scaling into rope_parameters.
    rope = (getattr(hf_config, "rope_parameters", None)
            or getattr(hf_config, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"Mixtral: rope type {rope_type!r} is not supported")
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 1_000_000.0))
    return MixtralConfig(
        src_vocab_size=hf_config.vocab_size, dim=hidden, norm_eps=hf_config.rms_norm_eps,
        nheads=heads, kvheads=hf_config.num_key_value_heads,
        nlayers=hf_config.num_hidden_layers, hidden_dim=hf_config.intermediate_size,
        p_dropout=0.0, num_experts=hf_config.num_local_experts,
        top_k_experts=hf_config.num_experts_per_tok,
        max_expected_seq_len=hf_config.max_position_embeddings, rope_base=float(theta),
    )


_RENAMES = LLAMA_LAYOUT_RENAMES + ((r"\.block_sparse_moe\.gate\.", ".ff_sub_layer.gate."),)
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")


def _rotary_pairs_adjacent(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q/k projection rows from HF's rotary layout (pairs i, i + head/2) to
    FMS's (pairs 2i, 2i + 1), as FMS's Llama and Mistral adapters reorder them."""
    heads = weight.shape[0] // head_dim
    return weight.view(heads, 2, head_dim // 2, *weight.shape[1:]).transpose(1, 2).reshape(
        weight.shape)


def _hf_to_fms_names(sd: Mapping[str, Any], model_config: MixtralConfig | None = None,
                     **_) -> dict:
    """Hub keys -> FMS's: names, q/k rows in FMS's rotary order, and each
    layer's experts stacked as FMS's ConditionalFeedForward holds them:
    ``w13`` [experts, 2 * intermediate, hidden] (w1, the gate, then w3) and
    ``w2`` [experts, hidden, intermediate]. q/k/v are fused after this
    (``FmsPort.fused_prefix``)."""
    config = model_config or MixtralConfig()
    head_dim = config.dim // config.nheads
    out, experts = {}, {}
    for name, tensor in sd.items():
        match = _EXPERT.match(name)
        if match:
            layer, expert, which = int(match[1]), int(match[2]), match[3]
            experts.setdefault(layer, {})[expert, which] = tensor
            continue
        name = renamed(name, _RENAMES)
        if ".attn.in_proj.query." in name or ".attn.in_proj.key." in name:
            tensor = _rotary_pairs_adjacent(tensor, head_dim)
        out[name] = tensor
    for layer, weights in experts.items():
        count = 1 + max(expert for expert, _ in weights)
        missing = [f"experts.{e}.{w}" for e in range(count) for w in ("w1", "w2", "w3")
                   if (e, w) not in weights]
        if missing:
            raise ValueError(f"Mixtral checkpoint: layer {layer} lacks {', '.join(missing)}")
        prefix = f"base_model.layers.{layer}.ff_sub_layer.cond_ffn."
        out[prefix + "w13"] = torch.stack(
            [torch.cat([weights[e, "w1"], weights[e, "w3"]]) for e in range(count)])
        out[prefix + "w2"] = torch.stack([weights[e, "w2"] for e in range(count)])
    return out


FMS_PORT = FmsPort(
    fms_architecture=ARCHITECTURE, hf_architecture=HF_ARCHITECTURE, model_class=Mixtral,
    config_from_hf=mixtral_config_from_hf, hf_to_fms_names=_hf_to_fms_names,
    fused_prefix="base_model.layers.",
)
