"""Published widths, depth cut: does vllm-accel load and generate them?

Each entry below is a published config.json's fields (random weights, written
offline by HF's own class, fewer layers). The engine loads the checkpoint and
generates greedily from token ids (a vision model also from a chat prompt
with one noise image, ``--image``); HF's own class generates from the same
inputs, and the script prints how many leading tokens agree (bfloat16 and
random weights: near ties may part them, so agreement is reported, not
required).
Embedders (``EMBEDDERS``) embed instead: the cosine of each embedding to
HF's, pooled as the checkpoint's sentence-transformers files say.

    .venv/bin/python scripts/real_widths.py [--models mixtral,...] [--device cpu|cuda]
                                            [--dtype bfloat16|float32] [--tokens 8]
                                            [--image 448x336]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

# Mistral-Small-3.1-24B: Mistral text (no window), the Pixtral tower.
_MISTRAL3_TEXT = dict(
    model_type="mistral", hidden_size=5120, intermediate_size=32768, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, num_hidden_layers=40, vocab_size=131072,
    rms_norm_eps=1e-5, max_position_embeddings=131072, sliding_window=None,
    rope_parameters={"rope_type": "default", "rope_theta": 1e9}, tie_word_embeddings=False)
_MISTRAL3_VISION = dict(
    model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
    num_hidden_layers=24, patch_size=14, image_size=1540, num_channels=3, hidden_act="silu",
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

_QWEN3_VL_TEXT = dict(
    model_type="qwen3_vl_text", hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, num_hidden_layers=36, vocab_size=151936,
    rms_norm_eps=1e-6, max_position_embeddings=262144, attention_bias=False,
    rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_interleaved": True,
                     "mrope_section": [24, 20, 20]},
    tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)
_QWEN3_VL_VISION = dict(
    model_type="qwen3_vl", depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
    in_channels=3, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
    out_hidden_size=2560, num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh",
    deepstack_visual_indexes=[5, 11, 17])

# model -> (HF config class name, the published fields, the depth cut)
CONFIGS = {
    "mistral3": ("Mistral3Config", dict(
        architectures=["Mistral3ForConditionalGeneration"], text_config=_MISTRAL3_TEXT,
        vision_config=_MISTRAL3_VISION, spatial_merge_size=2, image_token_index=10,
        projector_hidden_act="gelu", vision_feature_layer=-1, multimodal_projector_bias=False,
        tie_word_embeddings=False),
        dict(text_config={**_MISTRAL3_TEXT, "num_hidden_layers": 2},
             vision_config={**_MISTRAL3_VISION, "num_hidden_layers": 2})),
    # Qwen3-VL-4B-Instruct: Qwen3 text (head_dim 128 over 2,560, q/k norms,
    # interleaved M-RoPE), a 24-block tower with DeepStack from blocks 5, 11, 17.
    "qwen3_vl_4b": ("Qwen3VLConfig", dict(
        architectures=["Qwen3VLForConditionalGeneration"], text_config=_QWEN3_VL_TEXT,
        vision_config=_QWEN3_VL_VISION, image_token_id=151655, video_token_id=151656,
        vision_start_token_id=151652, vision_end_token_id=151653, tie_word_embeddings=True),
        dict(text_config={**_QWEN3_VL_TEXT, "num_hidden_layers": 3},
             vision_config={**_QWEN3_VL_VISION, "depth": 3,
                            "deepstack_visual_indexes": [0, 1, 2]})),
    # Mixtral-8x7B-v0.1
    "mixtral": ("MixtralConfig", dict(
        architectures=["MixtralForCausalLM"], hidden_size=4096, intermediate_size=14336,
        num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32,
        num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, rms_norm_eps=1e-5,
        max_position_embeddings=32768, rope_theta=1e6, sliding_window=None,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2), dict(num_hidden_layers=2)),
    # granite-4.0-h-tiny: Mamba2 layers, attention in every tenth from the sixth,
    # 64 experts (top 6) beside a shared MLP in every layer.
    "granite4_hybrid": ("GraniteMoeHybridConfig", dict(
        architectures=["GraniteMoeHybridForCausalLM"], hidden_size=1536,
        intermediate_size=512, shared_intermediate_size=1024, num_local_experts=64,
        num_experts_per_tok=6, num_attention_heads=12, num_key_value_heads=4,
        num_hidden_layers=40,
        layer_types=["attention" if i % 10 == 5 else "mamba" for i in range(40)],
        mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, mamba_conv_bias=True,
        mamba_proj_bias=False, position_embedding_type="nope", vocab_size=100352,
        embedding_multiplier=12.0, logits_scaling=6.0, residual_multiplier=0.22,
        attention_multiplier=0.0078125, rms_norm_eps=1e-5, max_position_embeddings=131072,
        tie_word_embeddings=True, bos_token_id=100257, eos_token_id=100257,
        pad_token_id=100256),
        dict(num_hidden_layers=7, layer_types=["mamba"] * 5 + ["attention", "mamba"])),
    # gpt-oss-20b (its published config.json, unquantized): windowed and full
    # attention alternating, sinks, YaRN, 32 experts (top 4) with biases.
    "gpt_oss": ("GptOssConfig", dict(
        architectures=["GptOssForCausalLM"], hidden_size=2880, intermediate_size=2880,
        head_dim=64, num_attention_heads=64, num_key_value_heads=8, num_hidden_layers=24,
        num_local_experts=32, num_experts_per_tok=4, vocab_size=201088, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
        max_position_embeddings=131072, swiglu_limit=7.0, tie_word_embeddings=False,
        attention_bias=True, bos_token_id=199998, eos_token_id=200002, pad_token_id=199999),
        dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])),
    # Bamba-9B: Mamba2 layers, attention in layers 9, 18 and 27.
    "bamba": ("BambaConfig", dict(
        architectures=["BambaForCausalLM"], hidden_size=4096, intermediate_size=14336,
        num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32,
        attn_layer_indices=[9, 18, 27], mamba_n_heads=128, mamba_d_head=64,
        mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False,
        vocab_size=128256, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=262144, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=0, pad_token_id=0), dict(num_hidden_layers=3, attn_layer_indices=[1])),
}


# Embedders (pooling): model -> (HF config class name, the published fields,
# the depth cut, sentence-transformers' pooling, extra engine options).
EMBEDDERS = {
    # granite-embedding-125m-english: RoBERTa, CLS pooling, normalized.
    "granite_embedding_125m": ("RobertaConfig", dict(
        architectures=["RobertaModel"], hidden_size=768, intermediate_size=3072,
        num_attention_heads=12, num_hidden_layers=12, vocab_size=50265,
        max_position_embeddings=514, type_vocab_size=1, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, layer_norm_eps=1e-12, hidden_act="gelu"), {}, "cls", {}),
    # Qwen3-Embedding-0.6B: Qwen3, last-token pooling, normalized.
    "qwen3_embedding_0_6b": ("Qwen3Config", dict(
        architectures=["Qwen3ForCausalLM"], hidden_size=1024, intermediate_size=3072,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_hidden_layers=28,
        vocab_size=151669, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643),
        dict(num_hidden_layers=4), "lasttoken", {"runner": "pooling"}),
    # all-mpnet-base-v2: MPNetModel's weights, its config naming MPNetForMaskedLM;
    # mean pooling, normalized.
    "all_mpnet_base_v2": ("MPNetConfig", dict(
        architectures=["MPNetForMaskedLM"], hidden_size=768, intermediate_size=3072,
        num_attention_heads=12, num_hidden_layers=12, vocab_size=30527,
        max_position_embeddings=514, relative_attention_num_buckets=32, pad_token_id=1,
        bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5, hidden_act="gelu"), {}, "mean", {}),
}


def write_embedder(name: str, out: Path, dtype) -> Path:
    import torch
    import transformers

    from vllm_accel.testing.tiny_encoders import write_sentence_transformers
    from vllm_accel.testing.tiny_models import CHAT_TEMPLATE, _save_tokenizer, build_tokenizer

    config_class, fields, cut, pooling, _ = EMBEDDERS[name]
    config = getattr(transformers, config_class)(**{**fields, **cut})
    torch.manual_seed(0)
    transformers.AutoModel.from_config(config, dtype=dtype).save_pretrained(out)
    # As published: Qwen3-Embedding's weights are a Qwen3Model's (no "model."
    # prefix, no LM head), its config names Qwen3ForCausalLM.
    saved = json.loads((out / "config.json").read_text())
    saved["architectures"] = fields["architectures"]
    (out / "config.json").write_text(json.dumps(saved, indent=2))
    _save_tokenizer(build_tokenizer(), out, CHAT_TEMPLATE)  # ids are sent directly
    write_sentence_transformers(out, pooling, True, config.hidden_size, max_seq_length=512)
    return out


def embedder_agreement(name: str, path: Path, prompts, dtype_name: str, device: str) -> dict:
    """The engine's embeddings beside HF's class (pooled, normalized)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(model=str(path), dtype=dtype_name, max_model_len=256, seed=0,
              additional_config={"accel": {"device": device}}, **EMBEDDERS[name][4])
    start_s = time.perf_counter() - started
    outs = llm.embed([TokensPrompt(prompt_token_ids=p) for p in prompts], use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    ours = torch.stack([torch.tensor(o.outputs.embedding) for o in outs])
    model = AutoModel.from_pretrained(path, dtype=getattr(torch, dtype_name)).to(device).eval()
    hf = []
    for prompt in prompts:
        with torch.no_grad():
            hidden = model(torch.tensor([prompt], device=device)).last_hidden_state[0].float()
        pooled = {"cls": hidden[0], "mean": hidden.mean(0), "lasttoken": hidden[-1]}
        hf.append(F.normalize(pooled[EMBEDDERS[name][3]], dim=0))
    cosines = F.cosine_similarity(ours, torch.stack(hf).cpu(), dim=1)
    return {"dimensions": ours.shape[1], "engine_start_s": start_s,
            "cosine_to_hf": [round(c, 5) for c in cosines.tolist()]}


def write_checkpoint(name: str, out: Path, dtype, layers: int | None = None,
                     cut: dict | None = None, device: str = "cpu") -> Path:
    """Entry ``name``'s checkpoint in ``out``: its depth cut, or ``layers``
    deep, or the fields of ``cut`` in place of the entry's; the weights made
    on ``device``."""
    import torch
    import transformers

    from vllm_accel.testing.tiny_models import CHAT_TEMPLATE, _save_tokenizer, build_tokenizer

    config_class, fields, entry_cut = CONFIGS[name]
    cut = entry_cut if cut is None else cut
    if layers is not None:  # a deeper or shallower cut (Mamba2 layer kinds stay as listed)
        cut = {**cut, "num_hidden_layers": layers}
        if "layer_types" in cut:
            cut["layer_types"] = cut["layer_types"][:layers]
    config = getattr(transformers, config_class)(**{**fields, **cut})
    vision = hasattr(config, "vision_config")
    if vision:  # a tiny tokenizer with the family's image tokens: vLLM's processor needs them
        tokenizer, template = _vision_tokenizer(config)
    else:
        tokenizer, template = build_tokenizer(), CHAT_TEMPLATE
    torch.manual_seed(0)
    with torch.device(device):
        model = _auto_class(config).from_config(config, dtype=dtype)
    model.save_pretrained(out)
    del model
    _save_tokenizer(tokenizer, out, template)  # ids are sent directly
    if vision:
        _write_processor(out, config, tokenizer)
    return out


def _vision_tokenizer(config):
    """The tiny fixture's tokenizer and chat template for this family, its
    image token ids written into ``config``."""
    from vllm_accel.testing import tiny_mistral3, tiny_qwen2_5_vl

    if config.model_type == "mistral3":
        tokenizer = tiny_mistral3._tokenizer()
        config.image_token_index = tokenizer.convert_tokens_to_ids(tiny_mistral3.IMG)
        return tokenizer, tiny_mistral3.CHAT_TEMPLATE
    tokenizer, q = tiny_qwen2_5_vl._tokenizer(), tiny_qwen2_5_vl
    ids = tokenizer.convert_tokens_to_ids
    config.image_token_id, config.video_token_id = ids(q.IMAGE_PAD), ids(q.VIDEO_PAD)
    config.vision_start_token_id = ids(q.VISION_START)
    config.vision_end_token_id = ids(q.VISION_END)
    return tokenizer, q.CHAT_TEMPLATE


def _write_processor(out: Path, config, tokenizer) -> None:
    if config.model_type == "mistral3":
        _write_pixtral_processor(out, config)
        return
    from vllm_accel.testing.tiny_qwen2_5_vl import write_processor_files

    # Qwen3-VL-4B's image processor: 16-pixel patches, 2x2 merged, from
    # 256x256 up to 4096x4096 pixels.
    write_processor_files(out, tokenizer, "Qwen3VLProcessor", patch_size=16,
                          min_pixels=65536, max_pixels=16777216, mean=[0.5] * 3,
                          std=[0.5] * 3, video_processor_type="Qwen3VLVideoProcessor")


def _auto_class(config):
    import transformers

    return (transformers.AutoModelForImageTextToText if hasattr(config, "vision_config")
            else transformers.AutoModelForCausalLM)


def _write_pixtral_processor(out: Path, config) -> None:
    """Mistral-Small-3.1's image processor settings (its longest edge: the
    tower's image_size) and its processor's."""
    from vllm_accel.testing import tiny_mistral3

    vision = config.vision_config
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor", "patch_size": vision.patch_size,
        "spatial_merge_size": config.spatial_merge_size, "image_token": tiny_mistral3.IMG,
        "image_break_token": tiny_mistral3.IMG_BREAK, "image_end_token": tiny_mistral3.IMG_END}))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor",
        "image_processor_type": "PixtralImageProcessor", "do_resize": True,
        "do_rescale": True, "do_normalize": True, "do_convert_rgb": True, "resample": 3,
        "rescale_factor": 1 / 255, "size": {"longest_edge": vision.image_size},
        "patch_size": {"height": vision.patch_size, "width": vision.patch_size},
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711]}))


def image_prompt(path: Path, size: tuple[int, int]) -> tuple:
    """(chat text, a noise image of ``size``) for a vision checkpoint: its
    processor's chat template with one image and a question."""
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor

    from vllm_accel.patches import apply_patches

    apply_patches()  # the processors' torchvision stand-ins
    processor = AutoProcessor.from_pretrained(path)
    content = [{"type": "image"}, {"type": "text", "text": "What is in this image?"}]
    text = processor.apply_chat_template([{"role": "user", "content": content}],
                                         add_generation_prompt=True, tokenize=False)
    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return text, Image.fromarray(pixels)


def engine_tokens(path: Path, prompts, tokens: int, dtype: str, device: str) -> tuple:
    """``prompts``: token ids, or (chat text, image) pairs."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(model=str(path), dtype=dtype, max_model_len=256, seed=0,
              additional_config={"accel": {"device": device}})
    start_s = time.perf_counter() - started
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    requests = [{"prompt": p[0], "multi_modal_data": {"image": p[1]}} if isinstance(p, tuple)
                else TokensPrompt(prompt_token_ids=p) for p in prompts]
    outs = llm.generate(requests, params, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], start_s


def hf_tokens(path: Path, prompts, tokens: int, dtype, device: str) -> list[list[int]]:
    import torch
    from transformers import AutoConfig

    model_class = _auto_class(AutoConfig.from_pretrained(path))
    model = model_class.from_pretrained(path, dtype=dtype).to(device).eval()
    out = []
    for prompt in prompts:
        if isinstance(prompt, tuple):  # (chat text, image)
            from transformers import AutoProcessor

            inputs = AutoProcessor.from_pretrained(path)(
                text=[prompt[0]], images=[prompt[1]], return_tensors="pt").to(device)
            inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        else:
            ids = torch.tensor([prompt], device=device)
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        with torch.no_grad():
            generated = model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens,
                                       do_sample=False, pad_token_id=0)
        out.append(generated[0, inputs["input_ids"].shape[1]:].tolist())
    return out


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join([*CONFIGS, *EMBEDDERS]))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--layers", type=int, help="the depth cut (default: each entry's)")
    parser.add_argument("--image", default="448x336",
                        help="WxH of a noise image a third prompt of a vision model holds")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    results = {}
    for name in args.models.split(","):
        if name in EMBEDDERS:
            with tempfile.TemporaryDirectory() as tmp:
                path = write_embedder(name, Path(tmp) / name, dtype)
                vocab = EMBEDDERS[name][1]["vocab_size"]
                gen = torch.Generator().manual_seed(1)
                prompts = torch.randint(1000, vocab - 1, (2, 40), generator=gen).tolist()
                results[name] = embedder_agreement(name, path, prompts, args.dtype, args.device)
                print(name, json.dumps(results[name]), flush=True)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            path = write_checkpoint(name, Path(tmp) / name, dtype, args.layers)
            fields = CONFIGS[name][1]
            vocab = fields.get("text_config", fields)["vocab_size"]
            gen = torch.Generator().manual_seed(1)
            prompts = torch.randint(1000, vocab - 1, (2, 40), generator=gen).tolist()
            if "vision_config" in fields:
                size = tuple(int(v) for v in args.image.split("x"))
                prompts.append(image_prompt(path, size))
            try:
                ours, start_s = engine_tokens(path, prompts, args.tokens, args.dtype,
                                              args.device)
            except Exception as error:  # the failure is the result
                results[name] = {"error": f"{type(error).__name__}: {error}"[:800]}
                print(name, json.dumps(results[name]), flush=True)
                continue
            hf = hf_tokens(path, prompts, args.tokens, dtype, args.device)
            agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                     for x, y in zip(ours, hf)]
            results[name] = {"generated": [len(t) for t in ours], "engine_start_s": start_s,
                             "leading_tokens_equal_to_hf": agree, "of": args.tokens}
            print(name, json.dumps(results[name]), flush=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
