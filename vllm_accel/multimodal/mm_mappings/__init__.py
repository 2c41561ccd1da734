"""Multimodal mappings: each vision-language architecture's vision adapter
(``base.VisionAdapter`` is the contract with the runner), one module each.

Which adapter serves which HF ``model_type`` is a field of the architecture
table (``vllm_accel/architectures.py``); nothing is imported here, so an
adapter module (and FMS, torch, vLLM behind it) loads only when its model is
served. Adding an architecture = one module in this package + its table entry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_accel.architectures import by_model_type, load_object

if TYPE_CHECKING:
    from vllm_accel.multimodal.mm_mappings.base import VisionAdapter


def vision_adapter_class(hf_config: Any) -> type[VisionAdapter] | None:
    """The vision adapter for this HF config, or None for a text-only model."""
    arch = by_model_type(getattr(hf_config, "model_type", None))
    if arch is None or arch.vision_adapter is None:
        return None
    from vllm_accel.multimodal.mm_mappings.base import VisionAdapter

    cls = load_object(arch.vision_adapter)
    if not (isinstance(cls, type) and issubclass(cls, VisionAdapter)):
        raise TypeError(f"{arch.vision_adapter} is not a VisionAdapter subclass")
    return cls
