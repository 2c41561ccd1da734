"""Deterministic, offline generator of tiny random-weight HF checkpoints.

Tests need real-looking checkpoints (config, safetensors in hub key layout,
fast tokenizer, chat template, generation config) without network access.
Everything here is built from scratch: a byte-level BPE tokenizer trained on
a small built-in corpus, and random weights drawn from a seeded generator.

Usage:
    from vllm_accel.testing.tiny_models import make_tiny_model
    path = make_tiny_model("llama", tmp_path / "tiny-llama", seed=0)

    python -m vllm_accel.testing.tiny_models llama /tmp/tiny-llama --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

import torch
from safetensors.torch import save_file

SUPPORTED_ARCHS = ("llama", "granite")

# Shapes: small enough to build/run in well under a second, but with GQA
# (4 query heads sharing 2 KV heads) and head_dim 64 so parity tests exercise
# the same code paths as real models.
HIDDEN = 256
LAYERS = 4
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
INTERMEDIATE = 512
VOCAB = 384  # total tokenizer size incl. specials; a multiple of 8 (no padding rows)
MAX_POS = 2048

# std 0.1 (not the usual 0.02) so logits are clearly peaked and greedy
# decoding wanders through many different tokens instead of repeating one.
WEIGHT_STD = 0.1
NORM_NOISE = 0.05  # norms = 1 + noise, so a swapped/missing norm is detectable

# Granite multipliers, as in granite-3.x 2B except logits_scaling. lm_head is
# drawn with std WEIGHT_STD * logits_scaling, so after the division the
# logits are as varied as llama's, yet a forgotten division is still obvious.
GRANITE_MULTIPLIERS = {
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
    "attention_multiplier": 1.0 / HEAD_DIM,
    "logits_scaling": 4.0,
}
# Granite embeddings are scaled x12 while block outputs are scaled x0.22: with
# std 0.1 the current token's embedding dominates the residual stream and
# greedy output falls into short loops. 0.025 * 12 = 0.3 avoids that.
GRANITE_EMBED_STD = 0.025
# lm_head rows of tokens that should never be generated are scaled by this
# (not zeroed: keeps them random so there are no exact logit ties).
SUPPRESS_SCALE = 0.01

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
START_HEADER, END_HEADER, EOT = "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, START_HEADER, END_HEADER, EOT]  # ids 0..5

# Llama-3 style template. The bos is part of the template because chat
# prompts are tokenized with add_special_tokens=False (HF and vLLM alike).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

# Small fixed training corpus; byte-level BPE means any text still encodes.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still be a
useful model when the goal is testing: it loads fast, runs on any machine and
gives the same answer every time it is asked the same question.

Once upon a time there was a little robot who lived in a quiet town near the
sea. Every morning the robot walked to the harbour, counted the boats, and
wrote the numbers in a notebook: one, two, three, four, five, six, seven.
The people of the town liked the robot because it was kind and patient.

User: What is the capital of France?
Assistant: The capital of France is Paris. It is known for its museums, its
food and the tower that stands by the river.

In computer science, a language model assigns a probability to a sequence of
words. Modern models are trained on large amounts of text and generate new
text one token at a time. The attention mechanism lets every position look at
the positions that came before it, and the cache stores keys and values so
that the next step does not repeat the work of the previous ones.

def add(a, b):
    return a + b  # 1 + 2 = 3; 10 * 20 = 200; [x for x in range(100)]

Hello, world! How are you today? I am fine, thank you. Please write a short
poem about the weather, the mountains and the stars at night.
"""


def build_tokenizer():
    """Train a byte-level BPE on CORPUS and wrap it as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Byte-level pre-tokenizer/decoder: every byte has a token, so arbitrary
    # (unicode) text round-trips exactly -- needed by incremental detokenizers.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() != VOCAB:  # corpus too small for VOCAB merges
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB}")
    # Plain prompts get a bos like Llama 3 tokenizers do.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # keep decode() an exact inverse
        model_max_length=MAX_POS,
    )


def _hf_config(arch: str, tokenizer):
    from transformers import GraniteConfig, LlamaConfig

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    if arch == "llama":
        cfg = LlamaConfig(head_dim=HEAD_DIM, **common)
        cfg.architectures = ["LlamaForCausalLM"]
    else:
        # GraniteConfig has no head_dim argument: it is hidden // heads (= 64).
        cfg = GraniteConfig(**common, **GRANITE_MULTIPLIERS)
        cfg.architectures = ["GraniteForCausalLM"]
    return cfg


def _unprintable_ids(tokenizer) -> list[int]:
    """Ids of special tokens and of tokens that are not printable ASCII alone
    (control bytes, lone UTF-8 bytes that decode to U+FFFD)."""

    def printable(text: str) -> bool:
        return bool(text) and all(c == "\n" or (c.isascii() and c.isprintable()) for c in text)

    return [
        i
        for i in range(len(tokenizer))
        if tokenizer.convert_ids_to_tokens(i) in SPECIAL_TOKENS
        or not printable(tokenizer.decode([i]))
    ]


def _random_state_dict(
    vocab: int, seed: int, *, embed_std: float, lm_head_std: float, suppressed: list[int]
) -> dict[str, torch.Tensor]:
    """Random weights in HF hub key layout, drawn in a fixed order."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, std=WEIGHT_STD):
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std

    def norm():
        return 1.0 + NORM_NOISE * torch.randn(HIDDEN, generator=g, dtype=torch.float32)

    sd = {"model.embed_tokens.weight": normal(vocab, HIDDEN, std=embed_std)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm()
        sd[p + "self_attn.q_proj.weight"] = normal(HEADS * HEAD_DIM, HIDDEN)
        sd[p + "self_attn.k_proj.weight"] = normal(KV_HEADS * HEAD_DIM, HIDDEN)
        sd[p + "self_attn.v_proj.weight"] = normal(KV_HEADS * HEAD_DIM, HIDDEN)
        sd[p + "self_attn.o_proj.weight"] = normal(HIDDEN, HEADS * HEAD_DIM)
        sd[p + "post_attention_layernorm.weight"] = norm()
        sd[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        sd[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        sd[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
    sd["model.norm.weight"] = norm()
    lm_head = normal(vocab, HIDDEN, std=lm_head_std)
    lm_head[suppressed] *= SUPPRESS_SCALE
    sd["lm_head.weight"] = lm_head
    return sd


def make_tiny_model(
    arch: str, out_dir: str | os.PathLike, *, seed: int = 0, printable_only: bool = True
) -> pathlib.Path:
    """Write a complete tiny HF checkpoint for ``arch`` into ``out_dir``.

    The output is byte-for-byte identical for the same (arch, seed) and the
    same library versions. Returns the checkpoint directory.

    With ``printable_only`` (default) the lm_head rows of special tokens
    (incl. eos) and of non-printable/partial-UTF-8 byte tokens are shrunk so
    their logits sit near 0, far below the top logits: greedy output is then
    clean ASCII text that always runs to max_tokens (no early eos), and text
    from incremental detokenization matches a one-shot decode.
    """
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported arch {arch!r}; choose from {SUPPORTED_ARCHS}")
    from transformers import GenerationConfig

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out)
    # Some loaders only look at tokenizer_config.json for the template.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["chat_template"] = CHAT_TEMPLATE
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")

    cfg = _hf_config(arch, tokenizer)
    cfg.save_pretrained(out)

    eot = tokenizer.convert_tokens_to_ids(EOT)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, eot],  # stop on either, like Llama 3
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out)

    granite = arch == "granite"
    sd = _random_state_dict(
        cfg.vocab_size,
        seed,
        embed_std=GRANITE_EMBED_STD if granite else WEIGHT_STD,
        lm_head_std=WEIGHT_STD * (GRANITE_MULTIPLIERS["logits_scaling"] if granite else 1.0),
        suppressed=_unprintable_ids(tokenizer) if printable_only else [],
    )
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arch", choices=SUPPORTED_ARCHS)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--allow-unprintable",
        action="store_true",
        help="do not shrink lm_head rows of special/non-printable tokens",
    )
    args = parser.parse_args(argv)
    path = make_tiny_model(
        args.arch, args.out_dir, seed=args.seed, printable_only=not args.allow_unprintable
    )
    print(path)


if __name__ == "__main__":
    main()
