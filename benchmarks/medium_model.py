"""Write the larger Llamas the throughput benchmark's `--model-size` generates: random
weights (seeded), the tiny models' offline tokenizer. Offline, deterministic, a few seconds.

    medium:   ~90M, hidden 1024, 8 layers, 16 heads, 4 KV heads, intermediate 2816
    128m:     ~128M, hidden 1152, 9 layers, 18 heads, 6 KV heads, intermediate 3072
    moe100m:  a ~100M Mixtral: hidden 768, 5 layers, 12 heads, 4 KV heads, 8 experts
              of intermediate 1024, top 2 (~31M parameters active a token)

    .venv/bin/python benchmarks/medium_model.py OUT_DIR [--shape medium|128m]
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
}


def make_llama(out_dir: str, shape: str = "medium", seed: int = 0) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    from vllm_accel.testing.tiny_models import CHAT_TEMPLATE, _save_tokenizer, build_tokenizer

    tokenizer = build_tokenizer()
    experts = "num_local_experts" in SHAPES[shape]
    config_class, model_class = ((MixtralConfig, MixtralForCausalLM) if experts
                                 else (LlamaConfig, LlamaForCausalLM))
    config = config_class(
        vocab_size=len(tokenizer), **SHAPES[shape],
        max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )
    if experts:
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
