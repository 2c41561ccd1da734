"""How our FMS-style ports of models FMS lacks register with FMS.

A port module describes itself with one ``FmsPort`` (its ``FMS_PORT``);
``register_port`` makes ``fms.models.get_model("hf_pretrained", ...)`` load
that architecture's HF checkpoints into the port's model class, once per
process. The architecture table (``vllm_accel/architectures.py``) names the
port; the loader registers it before loading.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from vllm_accel.compat import fuse_unfused_weights, register_fms_config_mapping


@dataclass(frozen=True)
class FmsPort:
    fms_architecture: str  # the name FMS registers it under
    hf_architecture: str  # HF config.architectures[0]
    model_class: type[nn.Module]  # built as model_class(config=..., **get_model kwargs)
    config_from_hf: Callable[[Any], Any]  # HF config -> the model's FMS config
    # HF checkpoint keys -> ours: (state_dict, model_config=..., **_) -> dict
    hf_to_fms_names: Callable[..., Mapping[str, Any]]
    # Keys under this prefix hold an FMS-style decoder whose q/k/v and gate/up
    # are fused (when its config says fused_weights); None: nothing to fuse.
    fused_prefix: str | None = None
    # The FMS config's attribute holding that decoder's config (None: itself).
    text_config_attr: str | None = None


# HF's Llama-layout decoder keys -> FMS's names (the LM head, embedding,
# final norm, layers, attention projections and a block's two norms): what
# the ports of Llama-shaped checkpoints share; each adds its own after these.
LLAMA_LAYOUT_RENAMES: tuple[tuple[str, str], ...] = (
    (r"^lm_head\.", "head."),
    (r"^model\.embed_tokens\.", "base_model.embedding."),
    (r"^model\.norm\.", "base_model.dec_norm."),
    (r"^model\.layers\.", "base_model.layers."),
    (r"\.self_attn\.q_proj\.", ".attn.in_proj.query."),
    (r"\.self_attn\.k_proj\.", ".attn.in_proj.key."),
    (r"\.self_attn\.v_proj\.", ".attn.in_proj.value."),
    (r"\.self_attn\.o_proj\.", ".attn.dense."),
    (r"\.input_layernorm\.", ".ln."),
    (r"\.post_attention_layernorm\.", ".ff_ln."),
)


def renamed(name: str, renames: Iterable[tuple[str, str]]) -> str:
    """``name`` with each (pattern, replacement) of ``renames`` applied in turn."""
    for pattern, replacement in renames:
        name = re.sub(pattern, replacement, name)
    return name


_registered: set[str] = set()


def register_port(port: FmsPort) -> None:
    """Register ``port`` with FMS's registries; idempotent (FMS refuses duplicates)."""
    if port.fms_architecture in _registered:
        return
    from fms import models
    from fms.utils import serialization

    name = port.fms_architecture
    models.register_model(name, "hf", lambda **kwargs: port.model_class(**kwargs))
    serialization.register_adapter_step(name, "hf_to_fms_names", port.hf_to_fms_names)
    steps = ["hf_to_fms_names"]
    if port.fused_prefix is not None:
        serialization.register_adapter_step(name, "weight_fusion", _weight_fusion(port))
        steps.append("weight_fusion")
    serialization.register_adapter(name, "hf", steps)
    register_fms_config_mapping(port.hf_architecture, name, port.config_from_hf)
    _registered.add(name)


def _weight_fusion(port: FmsPort):
    def weight_fusion(state_dict: Mapping[str, Any], model_config=None, **_) -> Mapping[str, Any]:
        text_config = model_config
        if model_config is not None and port.text_config_attr:
            text_config = getattr(model_config, port.text_config_attr)
        if text_config is not None and not text_config.fused_weights:
            return state_dict
        prefix = port.fused_prefix
        decoder = {k: v for k, v in state_dict.items() if k.startswith(prefix)}
        rest = {k: v for k, v in state_dict.items() if not k.startswith(prefix)}
        return {**fuse_unfused_weights(decoder), **rest}

    return weight_fusion
