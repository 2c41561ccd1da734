"""A tiny GPT-OSS, made offline and deterministically with transformers' own
class and the tiny tokenizer the other text fixtures use.

Four layers in the config's default pattern: a window of
``GPT_OSS_WINDOW`` tokens in layers 0 and 2, full attention in 1 and 3
(shorter than the tests' longer prompts, ending inside a 32-token KV
block); a learned sink per head; biases in attention, router and experts;
each token routed to its top 2 of 4 experts. GPT-OSS's experts are as wide
as the hidden state (FMS's class assumes it; the published configs have it).

The experts' gate/up weights are drawn wider (``GATE_UP_STD``) so that the
published SwiGLU clamp (7.0) binds for some tokens; the clamp itself keeps
the published value (transformers before 5.20 ignores the config's and
computes 7.0). YaRN's pre-training length differs from the published one
(256 positions, factor 8 to the 2,048 the fixture serves), so that the
rotary's interpolated and blended dimensions are ones short prompts turn.
"""

from __future__ import annotations

import os
import pathlib

import torch

from vllm_accel.testing.tiny_models import (
    EXPERTS, EXPERTS_PER_TOKEN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, MAX_POS, NORM_NOISE,
    ROUTER_STD, WEIGHT_STD, write_model_checkpoint,
)

GPT_OSS_WINDOW = 24
SWIGLU_LIMIT = 7.0
GATE_UP_STD = 0.3
YARN_ORIGINAL_POSITIONS = 256
SINK_MEAN, SINK_STD = 1.0, 1.0
SEED_OFFSET = 67_867_967  # its own weights, apart from the other fixtures'


def gpt_oss_config(tokenizer):
    from transformers import GptOssConfig

    config = GptOssConfig(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, num_local_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN,
        max_position_embeddings=MAX_POS, rms_norm_eps=1e-5, sliding_window=GPT_OSS_WINDOW,
        swiglu_limit=SWIGLU_LIMIT, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                         "factor": MAX_POS / YARN_ORIGINAL_POSITIONS, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": YARN_ORIGINAL_POSITIONS},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32")
    config.architectures = ["GptOssForCausalLM"]
    return config


def make_tiny_gpt_oss(out_dir: str | os.PathLike, *, seed: int = 0,
                      printable_only: bool = True) -> pathlib.Path:
    """The checkpoint in ``out_dir`` (``write_model_checkpoint``)."""
    from transformers import GptOssForCausalLM

    def fill_weights(model, g):
        for name, parameter in sorted(model.named_parameters()):
            if "norm" in name:
                value = 1.0 + NORM_NOISE * torch.randn(parameter.shape, generator=g)
            elif name.endswith("sinks"):
                value = SINK_MEAN + SINK_STD * torch.randn(parameter.shape, generator=g)
            elif ".router." in name:
                value = torch.randn(parameter.shape, generator=g) * ROUTER_STD
            elif name.endswith("experts.gate_up_proj"):
                value = torch.randn(parameter.shape, generator=g) * GATE_UP_STD
            else:
                value = torch.randn(parameter.shape, generator=g) * WEIGHT_STD
            parameter.copy_(value)

    return write_model_checkpoint(out_dir, GptOssForCausalLM, gpt_oss_config,
                                  seed + SEED_OFFSET, fill_weights, printable_only)
