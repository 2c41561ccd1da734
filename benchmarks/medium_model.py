"""Write the ~90M-parameter Llama the throughput benchmark's `--model-size medium` uses:
hidden 1024, 8 layers, 16 heads, 4 KV heads, intermediate 2816, random weights (seeded),
the tiny models' offline tokenizer. Offline, deterministic, a few seconds.

    .venv/bin/python benchmarks/medium_model.py OUT_DIR
"""
import sys


def make_medium_llama(out_dir: str, seed: int = 0) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from vllm_accel.testing.tiny_models import CHAT_TEMPLATE, _save_tokenizer, build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=1024, intermediate_size=2816,
        num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
        max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()  # HF's own init: std 0.02
    model.save_pretrained(out_dir)
    _save_tokenizer(tokenizer, __import__("pathlib").Path(out_dir), CHAT_TEMPLATE)
    return out_dir


if __name__ == "__main__":
    print(make_medium_llama(sys.argv[1]))
