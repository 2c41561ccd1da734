"""Tiny offline checkpoints, one per architecture in the table
(``vllm_accel/architectures.py``), named by its ``model_type``.

Usage:
    from vllm_accel.testing.fixtures import make_tiny_model
    path = make_tiny_model("llama", tmp_path / "tiny-llama", seed=0)

    python -m vllm_accel.testing.fixtures llama /tmp/tiny-llama --seed 0
"""

from __future__ import annotations

import argparse
import os
import pathlib

from vllm_accel.architectures import ARCHITECTURES, load_object

# SUPPORTED_ARCHS: the text-only causal LMs (tests are parametrised over it).
# VISION_ARCHS: vision-language models. ALL_ARCHS: everything make_tiny_model
# and the CLI accept.
SUPPORTED_ARCHS = tuple(a.model_type for a in ARCHITECTURES
                        if a.vision_adapter is None and a.encoder is None)
VISION_ARCHS = tuple(a.model_type for a in ARCHITECTURES if a.vision_adapter is not None)
ALL_ARCHS = SUPPORTED_ARCHS + VISION_ARCHS

# The fixtures written by a module of their own ("module:function" under
# vllm_accel.testing); tiny_models.make_tiny_checkpoint writes the others.
_OWN_MAKERS = {
    "qwen2_5_vl": "tiny_qwen2_5_vl:make_tiny_qwen2_5_vl",
    "qwen3_vl": "tiny_qwen3_vl:make_tiny_qwen3_vl",
    "gpt_bigcode": "tiny_gpt_bigcode:make_tiny_gpt_bigcode",
    "bamba": "tiny_bamba:make_tiny_bamba",
    "granitemoehybrid": "tiny_granite_hybrid:make_tiny_granite_hybrid",
    "granite_swa": "tiny_granite_swa:make_tiny_granite_swa",
    "gpt_oss": "tiny_gpt_oss:make_tiny_gpt_oss",
    "molmo": "tiny_molmo:make_tiny_molmo",
    "molmoe": "tiny_molmoe:make_tiny_molmoe",
    "mistral3": "tiny_mistral3:make_tiny_mistral3",
}


def make_tiny_model(arch: str, out_dir: str | os.PathLike, *, seed: int = 0,
                    printable_only: bool = True) -> pathlib.Path:
    """Write the tiny checkpoint of ``arch`` (a model_type) into ``out_dir``;
    deterministic for (arch, seed). ``printable_only``: see
    ``tiny_models.make_tiny_checkpoint``. Molmo gets its Qwen2 decoder
    (``tiny_molmo.make_tiny_molmo`` makes the OLMo one)."""
    if arch not in ALL_ARCHS:
        raise ValueError(f"unsupported arch {arch!r}; choose from {ALL_ARCHS}")
    if arch in _OWN_MAKERS:
        maker = load_object(f"vllm_accel.testing.{_OWN_MAKERS[arch]}")
        return maker(out_dir, seed=seed, printable_only=printable_only)
    from vllm_accel.testing.tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(arch, out_dir, seed=seed, printable_only=printable_only)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arch", choices=ALL_ARCHS)
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
