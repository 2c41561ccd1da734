"""A tiny Granite 4 hybrid (GraniteMoeHybridForCausalLM, as granite-4.0-h-tiny:
Mamba2 and attention layers, in each a shared SwiGLU MLP beside 4 experts
routed top-2, Granite's multipliers, no rotary embedding), made offline and
deterministically with transformers' own class and the tiny tokenizer the
other text fixtures use.

Four layers: Mamba2 in 0, 2 and 3, attention in 1; the Mamba2 shapes of the
tiny Bamba (tiny_bamba.py): 8 SSM heads in 2 groups, a state of 16, a 4-tap
convolution, 16-token scan chunks. ``granite_hybrid_config(tokenizer,
experts=0)`` is its dense form (granite-4.0-h-micro's).
"""

from __future__ import annotations

import os
import pathlib

from vllm_accel.testing.tiny_bamba import (
    MAMBA_CHUNK, MAMBA_CONV, MAMBA_GROUPS, MAMBA_HEAD_DIM, MAMBA_HEADS, MAMBA_STATE,
    random_mamba_weights,
)
from vllm_accel.testing.tiny_models import (
    GRANITE_EMBED_STD, GRANITE_MULTIPLIERS, HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS,
    MAX_POS, SEED_OFFSETS, WEIGHT_STD, write_model_checkpoint,
)

LAYER_TYPES = ["mamba", "attention", "mamba", "mamba"]
EXPERTS, TOP_K, EXPERT_INTERMEDIATE = 4, 2, 128


def granite_hybrid_config(tokenizer, experts: int = EXPERTS):
    from transformers import GraniteMoeHybridConfig

    config = GraniteMoeHybridConfig(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=EXPERT_INTERMEDIATE,
        shared_intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-5, hidden_act="silu", num_local_experts=experts,
        num_experts_per_tok=TOP_K, layer_types=list(LAYER_TYPES),
        position_embedding_type=None, mamba_n_heads=MAMBA_HEADS, mamba_d_head=MAMBA_HEAD_DIM,
        mamba_n_groups=MAMBA_GROUPS, mamba_d_state=MAMBA_STATE, mamba_d_conv=MAMBA_CONV,
        mamba_expand=2, mamba_chunk_size=MAMBA_CHUNK, mamba_conv_bias=True,
        mamba_proj_bias=False, tie_word_embeddings=False, **GRANITE_MULTIPLIERS,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32")
    config.architectures = ["GraniteMoeHybridForCausalLM"]
    return config


def make_tiny_granite_hybrid(out_dir: str | os.PathLike, *, seed: int = 0,
                             printable_only: bool = True) -> pathlib.Path:
    """The checkpoint in ``out_dir`` (``write_model_checkpoint``)."""
    from transformers import GraniteMoeHybridForCausalLM

    def fill_weights(model, g):
        random_mamba_weights(model, g)
        # As the tiny Granite: embeddings small (x12 by the multiplier), the
        # head scaled by logits_scaling (which divides the logits).
        model.model.embed_tokens.weight.normal_(0, GRANITE_EMBED_STD, generator=g)
        model.lm_head.weight.normal_(0, WEIGHT_STD * GRANITE_MULTIPLIERS["logits_scaling"],
                                    generator=g)

    return write_model_checkpoint(out_dir, GraniteMoeHybridForCausalLM, granite_hybrid_config,
                                  seed + SEED_OFFSETS["granitemoehybrid"], fill_weights,
                                  printable_only)
