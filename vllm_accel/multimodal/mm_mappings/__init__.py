"""Multimodal mappings: each vision-language architecture's vision adapter
(``base.VisionAdapter`` is the contract with the runner), one module each.

Which adapter serves which architecture is a field of the architecture
table (``vllm_accel/architectures.py``), found by the config's
``architectures`` (else its ``model_type``); nothing is imported here, so an
adapter module (and FMS, torch, vLLM behind it) loads only when its model is
served. Adding an architecture = one module in this package + its table entry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_accel.architectures import by_hf_names, by_model_type, load_object

if TYPE_CHECKING:
    from vllm_accel.multimodal.mm_mappings.base import VisionAdapter


def vision_adapter_class(hf_config: Any) -> type[VisionAdapter] | None:
    """The vision adapter for this HF config, or None for a text-only model."""
    # By architecture first: model_type may be shared (MolmoE's is Molmo's).
    arch = (by_hf_names(getattr(hf_config, "architectures", None))
            or by_model_type(getattr(hf_config, "model_type", None)))
    if arch is None or arch.vision_adapter is None:
        return None
    from vllm_accel.multimodal.mm_mappings.base import VisionAdapter

    cls = load_object(arch.vision_adapter)
    if not (isinstance(cls, type) and issubclass(cls, VisionAdapter)):
        raise TypeError(f"{arch.vision_adapter} is not a VisionAdapter subclass")
    return cls
