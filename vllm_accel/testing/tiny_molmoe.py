"""Deterministic, offline generator of a tiny random-weight MolmoE checkpoint.

MolmoE-1B-0924's hub layout with tiny shapes: a config.json with OLMo's keys
(``d_model``, ``n_heads``, ``n_layers``, ``moe_num_experts``, ``moe_top_k``,
``mlp_hidden_size``/``mlp_ratio``, ``attention_layer_norm``, ``rope_impl``,
``vision_backbone``, ...) under ``"architectures": ["OLMoForCausalLM"]`` and
``"model_type": "molmo"``, a torchvision-free remote config class
(``molmo_remote_code/config_molmoe.py``), and weights named as
``model/molmoe.py`` reads them (the experts in megablocks' layout). The
tokenizer, processor and vision backbone are the tiny Molmo's
(``tiny_molmo``), so prompts expand exactly as Molmo's do.

``REAL_WIDTHS`` writes MolmoE-1B's published decoder widths (d_model 2048,
16 heads, 64 experts top-8 of width 1024, vocabulary 50280 in 50304 rows +
128) with fewer layers; ``vision="full"`` gives Molmo-7B's ViT widths.

Usage:
    from vllm_accel.testing.tiny_molmoe import make_tiny_molmoe
    path = make_tiny_molmoe(tmp_path / "tiny-molmoe", seed=0)

    python -m vllm_accel.testing.tiny_molmoe /tmp/tiny-molmoe
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import shutil
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from vllm_accel.testing.tiny_models import (
    NORM_NOISE,
    SUPPRESS_SCALE,
    WEIGHT_STD,
    _write_json,
)
from vllm_accel.testing import tiny_molmo
from vllm_accel.testing.tiny_molmo import (
    ADDITIONAL_VOCAB,
    EMBEDDING_SIZE,
    ENDOFTEXT,
    REMOTE_CODE_DIR,
    VISION_SIZES,
    VIT_LAYERS,
)


@dataclass(frozen=True)
class TextWidths:
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 2
    moe_num_experts: int = 8
    moe_top_k: int = 2
    mlp_hidden_size: int | None = 512  # an expert is half as wide (OLMo's SwiGLU)
    mlp_ratio: int = 1
    embedding_size: int = EMBEDDING_SIZE
    vocab_size: int | None = None  # None: the text tokens (up to <|endoftext|>)

    @property
    def expert_width(self) -> int:
        return (self.mlp_hidden_size or self.mlp_ratio * self.d_model) // 2


# MolmoE-1B-0924's config.json; the depth is the caller's to cut (layers=).
REAL_WIDTHS = TextWidths(d_model=2048, n_heads=16, n_layers=16, moe_num_experts=64,
                         moe_top_k=8, mlp_hidden_size=None, mlp_ratio=1,
                         embedding_size=50304, vocab_size=50280)


def _config(text: TextWidths, vision: str, vision_backbone: dict, eos: int) -> dict:
    _, max_crops, margins, _ = VISION_SIZES[vision]
    return {
        "architectures": ["OLMoForCausalLM"],
        # No modeling code ships with the fixture: only the config is remote code.
        "auto_map": {"AutoConfig": "config_molmoe.MolmoConfig"},
        "model_type": "molmo",
        "activation_type": "swiglu", "additional_vocab_size": ADDITIONAL_VOCAB, "alibi": False,
        "attn_logit_softcapping": None, "final_logit_softcapping": None,
        "attention_layer_norm": True, "attention_layer_norm_with_affine": True,
        "bias_for_layer_norm": False, "block_type": "moe", "clip_qkv": None,
        "d_model": text.d_model, "embedding_size": text.embedding_size, "head_dim": None,
        "image_padding_embed": "pad_and_partial_pad", "image_pooling_2d": "attention-meanq",
        "image_pooling_h": 2, "image_pooling_w": 2, "image_projector": "mlp",
        "include_bias": False, "layer_norm_eps": 1e-5, "layer_norm_type": "rms",
        "layer_norm_with_affine": True, "max_crops": max_crops,
        "max_position_embeddings": 32768, "max_sequence_length": 4096,
        "mlp_hidden_size": text.mlp_hidden_size, "mlp_ratio": text.mlp_ratio,
        "moe_capacity_factor": 1.25, "moe_dropless": True, "moe_interleave": False,
        "moe_num_experts": text.moe_num_experts, "moe_shared_expert": False,
        "moe_top_k": text.moe_top_k, "multi_query_attention": None,
        "n_heads": text.n_heads, "n_kv_heads": None, "n_layers": text.n_layers,
        "norm_after": False, "normalize_input_embeds": False, "overlap_margins": margins,
        "qkv_bias": False, "rope": True, "rope_full_precision": True, "rope_impl": "llama",
        "rope_theta": 10000.0, "scale_logits": False, "torch_dtype": "float32",
        "use_cache": True, "use_cls_feature": False, "use_position_ids": True,
        "vision_backbone": {"image_model_type": "openai",
                            "image_head_dim": (vision_backbone["image_emb_dim"]
                                               // vision_backbone["image_num_heads"]),
                            **vision_backbone},
        "vit_layers": list(VIT_LAYERS), "vocab_size": text.vocab_size or eos + 1,
        "weight_tying": False, "eos_token_id": eos, "pad_token_id": eos,
    }


def _text_state_dict(text: TextWidths, seed: int, suppressed: list[int],
                     dtype: torch.dtype) -> dict:
    """Decoder weights in the hub's layout, drawn in ``dtype`` in a fixed
    order (in place: the real widths' billion values); wider models get
    smaller weights (activations keep the tiny model's scale)."""
    g = torch.Generator().manual_seed(seed)
    d, experts, width = text.d_model, text.moe_num_experts, text.expert_width
    std = WEIGHT_STD * (256 / d) ** 0.5

    def normal(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).mul_(std)

    def norm():
        return (1.0 + NORM_NOISE * torch.randn(d, generator=g)).to(dtype)

    t = "model.transformer."
    sd = {t + "wte.embedding": normal(text.embedding_size, d),
          t + "wte.new_embedding": normal(ADDITIONAL_VOCAB, d)}
    for i in range(text.n_layers):
        p = f"{t}blocks.{i}."
        sd[p + "att_proj.weight"] = normal(3 * d, d)  # q, k, v: multi-head
        sd[p + "q_norm.weight"], sd[p + "k_norm.weight"] = norm(), norm()
        sd[p + "attn_out.weight"] = normal(d, d)
        sd[p + "attn_norm.weight"], sd[p + "ff_norm.weight"] = norm(), norm()
        sd[p + "ffn.router.layer.weight"] = normal(experts, d)
        for w in ("w1", "v1", "w2"):  # gate, up, down (x1 @ w2): [experts * width, d]
            sd[p + f"ffn.experts.mlp.{w}"] = normal(experts * width, d)
    sd[t + "ln_f.weight"] = norm()
    head = normal(text.embedding_size, d)
    head[suppressed] *= SUPPRESS_SCALE
    sd[t + "ff_out.weight"] = head
    return sd


def make_tiny_molmoe(
    out_dir: str | os.PathLike, seed: int = 0, *, printable_only: bool = True,
    text: TextWidths = TextWidths(), vision: str = "small", vit_layers: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> pathlib.Path:
    """Write a tiny MolmoE checkpoint into ``out_dir`` and return it.

    Byte-for-byte identical for the same arguments and library versions.
    ``text``: the decoder's widths (``REAL_WIDTHS`` with ``dataclasses.replace``
    for a depth cut); ``vision``: "small" (the tests' backbone) or "full"
    (Molmo-7B's), ``vit_layers`` its depth where cut; ``dtype``: of the saved
    weights. ``printable_only``: see ``tiny_molmo.make_tiny_molmo``.
    """
    out, tokenizer = tiny_molmo.start_checkpoint(out_dir, vision)
    eos = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    vb = dict(VISION_SIZES[vision][0])
    if vit_layers is not None:
        vb["image_num_layers"] = vit_layers
    _write_json(out / "config.json", _config(text, vision, vb, eos))
    shutil.copyfile(REMOTE_CODE_DIR / "config_molmoe.py", out / "config_molmoe.py")

    suppressed = tiny_molmo.suppressed_ids(tokenizer) if printable_only else []
    sd = _text_state_dict(text, seed, suppressed, dtype)
    vision_sd = tiny_molmo._vision_state_dict(seed, vision, text.d_model, text.expert_width, vb)
    sd.update((k, v.to(dtype)) for k, v in vision_sd.items())
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--real-widths", type=int, metavar="LAYERS", default=None,
                        help="MolmoE-1B's widths with this many decoder layers")
    parser.add_argument("--vision", choices=list(VISION_SIZES), default="small")
    args = parser.parse_args(argv)
    text = (TextWidths() if args.real_widths is None
            else dataclasses.replace(REAL_WIDTHS, n_layers=args.real_widths))
    print(make_tiny_molmoe(args.out_dir, seed=args.seed, text=text, vision=args.vision))


if __name__ == "__main__":
    main()
