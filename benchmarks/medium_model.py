"""Write the larger Llamas the throughput benchmark's `--model-size` generates: random
weights (seeded), the tiny models' offline tokenizer. Offline, deterministic, a few seconds.

    medium:   ~90M, hidden 1024, 8 layers, 16 heads, 4 KV heads, intermediate 2816
    128m:     ~128M, hidden 1152, 9 layers, 18 heads, 6 KV heads, intermediate 3072
    moe100m:  a ~100M Mixtral: hidden 768, 5 layers, 12 heads, 4 KV heads, 8 experts
              of intermediate 1024, top 2 (~31M parameters active a token)
    hybrid100m: a ~100M Granite 4 hybrid (granite-4.0-h-tiny's layout, scaled):
              hidden 768, 8 layers, Mamba2 in 6 (24 heads of 64, one group,
              state 128, chunks of 256), attention in layers 3 and 7 (12 / 4
              heads, no rotary), in each a shared MLP of 1024 beside 8 experts
              of 384, top 2 (~59M decoder parameters a token runs through)

    .venv/bin/python benchmarks/medium_model.py OUT_DIR [--shape medium|128m|moe100m|hybrid100m]
"""
import argparse

# name -> Llama shape; parameter counts are of the decoder layers (the vocabulary is small).
SHAPES = {
    "medium": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                   num_key_value_heads=4, intermediate_size=2816),
    "128m": dict(hidden_size=1152, num_hidden_layers=9, num_attention_heads=18,
                 num_key_value_heads=6, intermediate_size=3072),
    "moe100m": dict(hidden_size=768, num_hidden_layers=5, num_attention_heads=12,
                    num_key_value_heads=4, intermediate_size=1024, num_local_experts=8,
                    num_experts_per_tok=2),
    "hybrid100m": dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12,
                       num_key_value_heads=4, intermediate_size=384,
                       shared_intermediate_size=1024, num_local_experts=8,
                       num_experts_per_tok=2,
                       layer_types=["mamba"] * 3 + ["attention"] + ["mamba"] * 3 + ["attention"],
                       position_embedding_type=None, mamba_n_heads=24, mamba_d_head=64,
                       mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2,
                       mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False),
}


def make_llama(out_dir: str, shape: str = "medium", seed: int = 0) -> str:
    import torch
    from transformers import (GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, LlamaConfig,
                              LlamaForCausalLM, MixtralConfig, MixtralForCausalLM)

    from vllm_accel.testing.tiny_models import CHAT_TEMPLATE, _save_tokenizer, build_tokenizer

    tokenizer = build_tokenizer()
    experts = "num_local_experts" in SHAPES[shape]
    hybrid = "layer_types" in SHAPES[shape]
    config_class, model_class = ((GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM) if hybrid
                                 else (MixtralConfig, MixtralForCausalLM) if experts
                                 else (LlamaConfig, LlamaForCausalLM))
    config = config_class(
        vocab_size=len(tokenizer), **SHAPES[shape],
        max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )
    if experts and not hybrid:
        config.sliding_window = None
    config.architectures = [model_class.__name__]
    torch.manual_seed(seed)
    model = model_class(config).eval()  # HF's own init: std 0.02
    model.save_pretrained(out_dir)
    _save_tokenizer(tokenizer, __import__("pathlib").Path(out_dir), CHAT_TEMPLATE)
    return out_dir


def make_medium_llama(out_dir: str, seed: int = 0) -> str:
    return make_llama(out_dir, "medium", seed)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="write a random-weight Llama of a named shape")
    p.add_argument("out_dir")
    p.add_argument("--shape", choices=list(SHAPES), default="medium")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(make_llama(a.out_dir, a.shape, a.seed))
