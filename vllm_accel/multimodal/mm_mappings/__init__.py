"""Multimodal mappings: HF ``model_type`` -> the util class that runs that
architecture's vision side (see ``base.MultiModalUtils`` for the contract).

Nothing is imported here: a mapping module (and FMS, torch, vLLM behind it)
loads only when ``get_mm_utils_cls`` is asked for its model type. Adding an
architecture = one module in this package + one line in ``_REGISTRY``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_accel.multimodal.mm_mappings.base import MultiModalUtils

# HF config.model_type -> "module:Class"
_REGISTRY: dict[str, str] = {
    "llava_next": "vllm_accel.multimodal.mm_mappings.llava_next:LlavaNextUtils",
    "qwen2_5_vl": "vllm_accel.multimodal.mm_mappings.qwen2_5_vl:Qwen2_5_VLUtils",
    "molmo": "vllm_accel.multimodal.mm_mappings.molmo:MolmoUtils",
}


def register_mm_utils(model_type: str, dotted_path: str) -> None:
    """Map a model_type to "package.module:ClassName" (imported on first use)."""
    module, sep, name = dotted_path.partition(":")
    if not (module and sep and name):
        raise ValueError(f"expected 'package.module:ClassName', got {dotted_path!r}")
    _REGISTRY[model_type] = dotted_path


def registered_model_types() -> list[str]:
    return sorted(_REGISTRY)


def get_mm_utils_cls(hf_config: Any) -> type[MultiModalUtils] | None:
    """The util class for this HF config, or None for a text-only model type."""
    path = _REGISTRY.get(getattr(hf_config, "model_type", None))
    if path is None:
        return None
    from vllm_accel.multimodal.mm_mappings.base import MultiModalUtils

    module, _, name = path.partition(":")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, MultiModalUtils)):
        raise TypeError(f"{path} is not a MultiModalUtils subclass")
    return cls
