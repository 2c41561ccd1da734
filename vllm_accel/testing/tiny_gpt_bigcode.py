"""A tiny GPT-BigCode (StarCoder's architecture: multi-query attention,
learned absolute positions, LayerNorm, GELU MLP, head tied to the token
embeddings), made offline and deterministically with transformers' own class
and the tiny tokenizer the other text fixtures use."""

from __future__ import annotations

import os
import pathlib

import torch

from vllm_accel.testing.tiny_models import (
    CHAT_TEMPLATE, HEADS, HIDDEN, INTERMEDIATE, LAYERS, MAX_POS, SUPPRESS_SCALE, WEIGHT_STD,
    _save_generation_config, _save_tokenizer, _unprintable_ids, build_tokenizer,
)


def make_tiny_gpt_bigcode(out_dir: str | os.PathLike, *, seed: int = 0,
                          printable_only: bool = True) -> pathlib.Path:
    """The checkpoint in ``out_dir``. ``printable_only``: the embedding rows
    (the tied head's) of special and unprintable tokens are shrunk, so greedy
    output is printable text that runs to max_tokens."""
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    _save_tokenizer(tokenizer, out, CHAT_TEMPLATE)
    config = GPTBigCodeConfig(
        vocab_size=len(tokenizer), n_positions=MAX_POS, n_embd=HIDDEN, n_layer=LAYERS,
        n_head=HEADS, n_inner=INTERMEDIATE, multi_query=True,
        activation_function="gelu_pytorch_tanh", tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32")
    config.architectures = ["GPTBigCodeForCausalLM"]
    g = torch.Generator().manual_seed(seed)
    model = GPTBigCodeForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if name.endswith(".bias"):
                parameter.copy_(torch.randn(parameter.shape, generator=g) * 0.02)
            elif ".ln_" in name or name.endswith("ln_f.weight"):
                parameter.copy_(1.0 + 0.1 * torch.randn(parameter.shape, generator=g))
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=g) * WEIGHT_STD)
        if printable_only:
            model.transformer.wte.weight[_unprintable_ids(tokenizer)] *= SUPPRESS_SCALE
    model.save_pretrained(out)
    _save_generation_config(tokenizer, out)
    return out
