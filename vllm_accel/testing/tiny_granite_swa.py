"""A tiny Granite SWA (Granite with sliding-window attention in some layers
and a learned attention sink per head in every layer), made offline and
deterministically with transformers' own class and the tiny tokenizer the
other text fixtures use.

Four layers in the config's default pattern: full attention in layer 0,
a window of ``GRANITE_SWA_WINDOW`` tokens in layers 1-3. The window (24) is
shorter than the tests' longer prompts and ends inside a 32-token KV block,
so attention is cut inside a block and vLLM frees the windowed layers'
blocks behind it. Sinks are drawn around 1 with std 1: with a few keys in
reach they take a clear share of a head's attention (a sink of 0 would
still change the softmax; one left out would show in every logit).
"""

from __future__ import annotations

import os
import pathlib

import torch

from vllm_accel.testing.tiny_models import (
    GRANITE_EMBED_STD, GRANITE_MULTIPLIERS, HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS,
    MAX_POS, NORM_NOISE, WEIGHT_STD, write_model_checkpoint,
)

GRANITE_SWA_WINDOW = 24
SINK_MEAN, SINK_STD = 1.0, 1.0
SEED_OFFSET = 32_452_843  # its own weights, apart from the other fixtures'


def granite_swa_config(tokenizer):
    from transformers import GraniteSWAConfig

    config = GraniteSWAConfig(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POS, rms_norm_eps=1e-5, hidden_act="silu",
        sliding_window=GRANITE_SWA_WINDOW, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32", **GRANITE_MULTIPLIERS)
    config.architectures = ["GraniteSWAForCausalLM"]
    return config


def make_tiny_granite_swa(out_dir: str | os.PathLike, *, seed: int = 0,
                          printable_only: bool = True) -> pathlib.Path:
    """The checkpoint in ``out_dir`` (``write_model_checkpoint``)."""
    from transformers import GraniteSWAForCausalLM

    # As the tiny Granite's: a small embedding (it is scaled x12) and a head
    # drawn logits_scaling times wider (its logits are divided by it).
    head_std = WEIGHT_STD * GRANITE_MULTIPLIERS["logits_scaling"]

    def fill_weights(model, g):
        for name, parameter in sorted(model.named_parameters()):
            if "norm" in name:
                value = 1.0 + NORM_NOISE * torch.randn(parameter.shape, generator=g)
            elif name.endswith("sinks"):
                value = SINK_MEAN + SINK_STD * torch.randn(parameter.shape, generator=g)
            elif name == "model.embed_tokens.weight":
                value = torch.randn(parameter.shape, generator=g) * GRANITE_EMBED_STD
            elif name == "lm_head.weight":
                value = torch.randn(parameter.shape, generator=g) * head_std
            else:
                value = torch.randn(parameter.shape, generator=g) * WEIGHT_STD
            parameter.copy_(value)

    return write_model_checkpoint(out_dir, GraniteSWAForCausalLM, granite_swa_config,
                                  seed + SEED_OFFSET, fill_weights, printable_only)
