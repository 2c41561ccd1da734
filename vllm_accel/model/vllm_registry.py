"""What vLLM's model registry must know of architectures we serve and vLLM
has no class for (MPNet's embedders, MolmoE).

vLLM resolves a checkpoint's ``architectures`` through its registry before any
platform sees the model: the class it finds says whether the model pools or
generates and how it attends, and (a multimodal class) which processor
expands its prompts. Our runner never builds these classes (it runs FMS's
models), so each only declares that interface.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.models.interfaces_base import attn_type, default_pooling_type

# HF architecture -> the class below that declares it.
ENCODER_EMBEDDERS = {"MPNetModel": "FmsEncoderEmbedder", "MPNetForMaskedLM": "FmsEncoderEmbedder"}
# HF architecture -> vLLM's own class whose interface and processing it shares:
# MolmoE-1B ("OLMoForCausalLM") has Molmo's processor and prompt layout.
VLLM_CLASSES = {"OLMoForCausalLM": "vllm.model_executor.models.molmo:MolmoForCausalLM"}


@attn_type("encoder_only")
@default_pooling_type(seq_pooling_type="CLS")
class FmsEncoderEmbedder(nn.Module):
    """An encoder-only embedder (bidirectional attention, no KV cache, CLS
    pooling unless sentence-transformers' files say otherwise)."""

    is_pooling_model = True

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        raise RuntimeError("vllm-accel runs this architecture through FMS in its own model "
                           "runner: serve it with VLLM_PLUGINS=accel on the accel platform.")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def register_with_vllm() -> None:
    """Add the architectures above to vLLM's registry (lazily: by name)."""
    from vllm import ModelRegistry

    for arch, class_name in ENCODER_EMBEDDERS.items():
        ModelRegistry.register_model(arch, f"{__name__}:{class_name}")
    for arch, path in VLLM_CLASSES.items():
        ModelRegistry.register_model(arch, path)
