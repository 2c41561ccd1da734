"""A tiny Bamba (Mamba2 layers with full attention in some, SwiGLU MLPs),
made offline and deterministically with transformers' own class and the tiny
tokenizer the other text fixtures use.

Four layers: Mamba2 in 0, 2 and 3, attention (GQA, rotary on half of each
head) in 1. The scan's chunk is 16 tokens, so the tests' prompts cross scan
chunks and vLLM's prefill chunks cut through them. Two SSM groups for eight
SSM heads (each group's B/C shared by four heads), a state of 16 and a
4-tap convolution, as real Bamba checkpoints (n_groups 1, d_state 128,
chunk 256) have them in miniature.
"""

from __future__ import annotations

import math
import os
import pathlib

import torch

from vllm_accel.testing.tiny_models import (
    HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS, MAX_POS, NORM_NOISE, ROUTER_STD,
    SEED_OFFSETS, WEIGHT_STD, write_model_checkpoint,
)

ATTENTION_LAYERS = [1]
MAMBA_HEADS = 8
MAMBA_HEAD_DIM = 64  # mamba_expand * HIDDEN / MAMBA_HEADS
MAMBA_GROUPS = 2
MAMBA_STATE = 16
MAMBA_CONV = 4
MAMBA_CHUNK = 16


def bamba_config(tokenizer):
    from transformers import BambaConfig

    config = BambaConfig(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POS, rms_norm_eps=1e-5, hidden_act="silu",
        attn_layer_indices=list(ATTENTION_LAYERS), mamba_n_heads=MAMBA_HEADS,
        mamba_d_head=MAMBA_HEAD_DIM, mamba_n_groups=MAMBA_GROUPS, mamba_d_state=MAMBA_STATE,
        mamba_d_conv=MAMBA_CONV, mamba_expand=2, mamba_chunk_size=MAMBA_CHUNK,
        mamba_conv_bias=True, mamba_proj_bias=False, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32")
    config.architectures = ["BambaForCausalLM"]
    return config


def random_mamba_weights(model, g: torch.Generator) -> None:
    """Every parameter of a hybrid Mamba2 model drawn from ``g`` in name
    order: norms near 1, decay rates and time steps spread as Mamba2's own
    init spreads them, routers (Granite 4's) wide enough for clear choices,
    the rest normal."""
    for name, parameter in sorted(model.named_parameters()):
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name:  # RMSNorms, the mixer's gated norm among them
            value = 1.0 + NORM_NOISE * torch.randn(parameter.shape, generator=g)
        elif leaf == "A_log":  # decay rates spread as Mamba2's init spreads them
            value = torch.log(torch.linspace(1.0, 16.0, parameter.numel())) \
                + 0.1 * torch.randn(parameter.shape, generator=g)
        elif leaf == "dt_bias":  # softplus(dt_bias) ~ 0.01 .. 0.3: slow and fast heads
            dt = torch.exp(torch.rand(parameter.shape, generator=g)
                           * (math.log(0.3) - math.log(0.01)) + math.log(0.01))
            value = dt + torch.log(-torch.expm1(-dt))
        elif leaf == "D":
            value = 1.0 + 0.1 * torch.randn(parameter.shape, generator=g)
        elif name.endswith("conv1d.weight"):  # 4 taps per channel
            value = torch.randn(parameter.shape, generator=g) * 0.3
        elif name.endswith("router.weight"):
            value = torch.randn(parameter.shape, generator=g) * ROUTER_STD
        elif leaf == "bias":
            value = torch.randn(parameter.shape, generator=g) * 0.02
        else:
            value = torch.randn(parameter.shape, generator=g) * WEIGHT_STD
        parameter.copy_(value)


def make_tiny_bamba(out_dir: str | os.PathLike, *, seed: int = 0,
                    printable_only: bool = True) -> pathlib.Path:
    """The checkpoint in ``out_dir`` (``write_model_checkpoint``)."""
    from transformers import BambaForCausalLM

    return write_model_checkpoint(out_dir, BambaForCausalLM, bamba_config,
                                  seed + SEED_OFFSETS["bamba"], random_mamba_weights,
                                  printable_only)
