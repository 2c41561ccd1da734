"""The tiny LlavaNext (Granite Vision) fixture, checked against HF transformers,
FMS and vLLM's own multimodal processor; and the torchvision-free shims
(vllm_accel.patches) that vLLM's LlavaNext/Qwen2.5-VL processing
needs. Offline and CPU only."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from vllm_accel.testing import tiny_models
from vllm_accel.testing.fixtures import make_tiny_model

PYTHON = sys.executable
IMAGE_TOKEN_ID = 6
LOGITS_SCALING = tiny_models.GRANITE_MULTIPLIERS["logits_scaling"]
HUB_PREFIXES = ("language_model.model.", "language_model.lm_head.", "vision_tower.vision_model.",
                "multi_modal_projector.", "image_newline")

no_torchvision = pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is not None,
    reason="the shims only act when torchvision is missing",
)


def _image(height: int, width: int, seed: int = 0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _chat(*parts: str) -> list[dict]:
    """One user message; "<image>" entries become image parts."""
    content = [{"type": "image"} if p == "<image>" else {"type": "text", "text": p}
               for p in parts]
    return [{"role": "user", "content": content}]


def _hashes(path: pathlib.Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> pathlib.Path:
    return make_tiny_model("llava_next", tmp_path_factory.mktemp("llava_next") / "m")


@pytest.fixture(scope="module")
def hf_model(ckpt):
    from transformers import LlavaNextForConditionalGeneration

    model, info = LlavaNextForConditionalGeneration.from_pretrained(
        ckpt, dtype=torch.float32, output_loading_info=True
    )
    model.loading_info = info
    return model.eval()


@pytest.fixture(scope="module")
def processor(ckpt):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def fms_model(ckpt):
    """(model, captured log text of the load)."""
    from fms.models import get_model

    records: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Capture(level=logging.WARNING)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        model = get_model(
            "hf_pretrained", model_path=str(ckpt), device_type="cpu", data_type=torch.float32
        ).eval()
    finally:
        root.removeHandler(handler)
    return model, "\n".join(records)


def _hf_inputs(processor, images, *parts):
    prompt = processor.apply_chat_template(_chat(*parts), add_generation_prompt=True)
    # The template already starts with bos: tokenize without adding another
    # (as vLLM does for chat prompts).
    return processor(images=images, text=prompt, add_special_tokens=False, return_tensors="pt")


# --------------------------------------------------------------------------
# 1. The files: deterministic, hub layout, HF loads every weight.
# --------------------------------------------------------------------------

def test_deterministic_fast_and_hub_layout(ckpt, tmp_path):
    start = time.perf_counter()
    again = make_tiny_model("llava_next", tmp_path / "again", seed=0)
    elapsed = time.perf_counter() - start
    assert elapsed < 30, f"building took {elapsed:.1f} s"
    assert _hashes(again) == _hashes(ckpt)
    other = _hashes(make_tiny_model("llava_next", tmp_path / "seed1", seed=1))
    assert other["model.safetensors"] != _hashes(ckpt)["model.safetensors"]
    assert {k: v for k, v in other.items() if k != "model.safetensors"} == {
        k: v for k, v in _hashes(ckpt).items() if k != "model.safetensors"
    }
    for required in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "generation_config.json", "preprocessor_config.json",
                     "processor_config.json", "chat_template.jinja"):
        assert (ckpt / required).exists(), required

    sd = load_file(ckpt / "model.safetensors")
    assert not [k for k in sd if not k.startswith(HUB_PREFIXES)]
    assert "image_newline" in sd and "language_model.lm_head.weight" in sd
    assert "vision_tower.vision_model.encoder.layers.3.mlp.fc2.bias" in sd
    assert sd["multi_modal_projector.linear_1.weight"].shape == (256, 3 * 64)


def test_config(ckpt):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(ckpt)
    assert cfg.architectures == ["LlavaNextForConditionalGeneration"]
    assert cfg.image_token_index == IMAGE_TOKEN_ID
    assert cfg.vision_feature_layer == [-4, -2, -1]
    assert cfg.vision_feature_select_strategy == "full"
    assert cfg.image_grid_pinpoints == [[64, 64], [64, 128], [128, 64], [128, 128], [64, 192],
                                        [192, 64]]
    assert cfg.text_config.model_type == "granite" and cfg.text_config.logits_scaling == 4.0
    assert cfg.vision_config.model_type == "siglip_vision_model"
    assert (cfg.vision_config.image_size, cfg.vision_config.patch_size) == (64, 8)
    assert not cfg.tie_word_embeddings and not cfg.text_config.tie_word_embeddings


def test_hf_loads_every_weight(ckpt, hf_model):
    info = hf_model.loading_info
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"] and not info["error_msgs"], info
    sd = load_file(ckpt / "model.safetensors")
    hf_sd = hf_model.state_dict()
    assert sum(t.numel() for t in hf_sd.values()) == sum(t.numel() for t in sd.values())
    # Legacy (hub) keys were converted, not left at their init values.
    assert torch.equal(hf_sd["lm_head.weight"], sd["language_model.lm_head.weight"])
    assert torch.equal(hf_sd["model.language_model.embed_tokens.weight"],
                       sd["language_model.model.embed_tokens.weight"])
    assert torch.equal(hf_sd["model.image_newline"], sd["image_newline"])
    assert torch.equal(hf_sd["model.multi_modal_projector.linear_2.bias"],
                       sd["multi_modal_projector.linear_2.bias"])
    vision = {k.split("vision_tower.", 1)[1].removeprefix("vision_model."): v
              for k, v in hf_sd.items() if "vision_tower." in k}
    assert torch.equal(vision["encoder.layers.2.self_attn.q_proj.weight"],
                       sd["vision_tower.vision_model.encoder.layers.2.self_attn.q_proj.weight"])
    assert torch.equal(vision["embeddings.patch_embedding.weight"],
                       sd["vision_tower.vision_model.embeddings.patch_embedding.weight"])


def test_processor_offline_without_torchvision(ckpt, processor):
    from transformers import AutoTokenizer

    assert type(processor).__name__ == "LlavaNextProcessor"
    if importlib.util.find_spec("torchvision") is None:
        assert type(processor.image_processor).__name__ == "LlavaNextImageProcessorPil"
    assert processor.patch_size == 8
    assert processor.vision_feature_select_strategy == "full"
    assert processor.num_additional_image_tokens == 0
    assert processor.image_token == "<image>" and processor.image_token_id == IMAGE_TOKEN_ID
    assert processor.image_processor.image_grid_pinpoints == tiny_models.IMAGE_GRID_PINPOINTS

    tok = AutoTokenizer.from_pretrained(ckpt)
    assert len(tok) == 384
    assert tok.convert_tokens_to_ids("<image>") == IMAGE_TOKEN_ID
    assert tok("a<image>b", add_special_tokens=False).input_ids.count(IMAGE_TOKEN_ID) == 1
    assert tok.decode(tok("x<image>y").input_ids, skip_special_tokens=True) == "xy"

    # OpenAI-style content lists and plain strings both render.
    text = tok.apply_chat_template(_chat("<image>", "What is this?"), add_generation_prompt=True,
                                   tokenize=False)
    assert text == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n<image>\n"
                    "What is this?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    plain = tok.apply_chat_template([{"role": "user", "content": "<image>\nWhat is this?"}],
                                    add_generation_prompt=True, tokenize=False)
    assert plain == text
    assert processor.apply_chat_template(_chat("<image>", "What is this?"),
                                         add_generation_prompt=True) == text

    # An 80x50 (width x height) image picks the 1x2-tile pinpoint [64, 128]:
    # base tile 8x8=64 + unpadded 8 rows x 12 columns + 8 newlines = 168.
    enc = _hf_inputs(processor, _image(50, 80), "<image>", "Describe the picture.")
    assert enc["pixel_values"].shape == (1, 3, 3, 64, 64)
    assert enc["image_sizes"].tolist() == [[50, 80]]
    assert (enc["input_ids"] == IMAGE_TOKEN_ID).sum().item() == 168
    assert enc["input_ids"][0, 0].item() == tok.bos_token_id
    assert enc["input_ids"][0, 1].item() != tok.bos_token_id


def test_hf_greedy_uses_the_image(processor, hf_model):
    enc = _hf_inputs(processor, _image(50, 80), "<image>", "Describe the picture.")
    other = _hf_inputs(processor, _image(50, 80, seed=1), "<image>", "Describe the picture.")
    with torch.no_grad():
        out = hf_model.generate(**enc, max_new_tokens=16, do_sample=False)
        out_other = hf_model.generate(**other, max_new_tokens=16, do_sample=False)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    new_other = out_other[0, other["input_ids"].shape[1]:].tolist()
    assert len(new) == 16 and len(set(new)) >= 5  # no early eos, not a loop
    text = processor.tokenizer.decode(new)
    assert text.isascii() and "\ufffd" not in text
    assert new != new_other  # another image, another answer


# --------------------------------------------------------------------------
# 2. FMS: every weight placed; logits equal HF's (HF ignores logits_scaling).
# --------------------------------------------------------------------------

def test_fms_loads_every_weight(ckpt, fms_model):
    model, log = fms_model
    # FMS logs (and otherwise ignores) checkpoint keys it could not place.
    assert "not copied into model" not in log, log
    sd = load_file(ckpt / "model.safetensors")
    fms_sd = model.state_dict()
    assert sum(t.numel() for t in fms_sd.values()) == sum(t.numel() for t in sd.values())
    v, fv = "vision_tower.vision_model.", "vision_tower.base_model."
    pairs = {
        fv + "embeddings.patch_embedding.weight": v + "embeddings.patch_embedding.weight",
        fv + "embeddings.position_embedding.weight": v + "embeddings.position_embedding.weight",
        fv + "encoder.layers.1.layer_norm1.bias": v + "encoder.layers.1.layer_norm1.bias",
        fv + "encoder.layers.3.mlp.w1.weight": v + "encoder.layers.3.mlp.fc1.weight",
        fv + "encoder.layers.3.attn.dense.bias": v + "encoder.layers.3.self_attn.out_proj.bias",
        fv + "post_layernorm.weight": v + "post_layernorm.weight",
        "vision_tower.head.probe": v + "head.probe",
        "vision_tower.head.mlp.w2.weight": v + "head.mlp.fc2.weight",
        "multi_modal_projector.linear_1.weight": "multi_modal_projector.linear_1.weight",
        "multi_modal_projector.linear_2.bias": "multi_modal_projector.linear_2.bias",
        "image_newline": "image_newline",
        "language_model.base_model.embedding.weight": "language_model.model.embed_tokens.weight",
        "language_model.head.weight": "language_model.lm_head.weight",
    }
    for fms_key, hub_key in pairs.items():
        assert torch.equal(fms_sd[fms_key], sd[hub_key]), fms_key
    # SigLIP q/k/v are fused (no RoPE, so no permutation).
    qkv = torch.cat([sd[f"{v}encoder.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(fms_sd[fv + "encoder.layers.0.attn.in_proj.qkv_fused.weight"], qkv)
    for name, t in fms_sd.items():
        assert torch.isfinite(t).all(), name


def _fms_logits(model, enc):
    mm = {"pixel_values": enc["pixel_values"], "image_sizes": enc["image_sizes"]}
    embeds, _ = model.prepare_inputs_for_generation(0, enc["input_ids"], mm)
    return model(embeds)


def test_fms_matches_hf_one_image(processor, hf_model, fms_model):
    model, _ = fms_model
    enc = _hf_inputs(processor, _image(50, 80), "<image>", "Describe the picture.")
    with torch.no_grad():
        hf_logits = hf_model(**enc).logits
        fms_logits = _fms_logits(model, enc)
        # The merged image features themselves, before the text model.
        hf_feats = torch.cat(hf_model.model.get_image_features(
            enc["pixel_values"], enc["image_sizes"]).pooler_output)
        fms_feats = model.pack_image_features(
            model.get_image_features(enc["pixel_values"], enc["image_sizes"]),
            enc["image_sizes"], image_newline=model.image_newline)
    assert fms_feats.shape == hf_feats.shape == (168, 256)
    torch.testing.assert_close(fms_feats, hf_feats, atol=1e-5, rtol=1e-5)
    assert fms_logits.shape == hf_logits.shape
    torch.testing.assert_close(fms_logits, hf_logits / LOGITS_SCALING, atol=1e-4, rtol=1e-4)
    assert fms_logits[0, -1].std() > 0.5  # not flat


def test_fms_matches_hf_two_images_one_prompt(processor, hf_model, fms_model):
    model, _ = fms_model
    # 80x50 -> 1x2 tiles, 60x150 -> 3x1 tiles (pixel_values padded to 4 patches).
    enc = _hf_inputs(processor, [_image(50, 80), _image(150, 60, seed=2)],
                     "<image>", "Compare", "<image>", "these.")
    assert enc["pixel_values"].shape == (2, 4, 3, 64, 64)
    with torch.no_grad():
        hf_logits = hf_model(**enc).logits
        fms_logits = _fms_logits(model, enc)
    torch.testing.assert_close(fms_logits, hf_logits / LOGITS_SCALING, atol=1e-4, rtol=1e-4)


def test_fms_merges_images_into_batch_row_0_only(processor, fms_model):
    """Known FMS 1.13.1 limitation: prepare_inputs_for_generation scatters
    the features of *all* images into row 0 (positions from input_ids[0]).
    A batch of two prompts with one image each fails. If this starts passing,
    FMS changed."""
    model, _ = fms_model
    prompt = processor.apply_chat_template(_chat("<image>", "Describe."),
                                           add_generation_prompt=True)
    enc = processor(images=[[_image(50, 80)], [_image(50, 80)]], text=[prompt, prompt],
                    add_special_tokens=False, return_tensors="pt")
    with pytest.raises(RuntimeError, match="shape mismatch"):
        model.prepare_inputs_for_generation(
            0, enc["input_ids"],
            {"pixel_values": enc["pixel_values"], "image_sizes": enc["image_sizes"]})


# --------------------------------------------------------------------------
# 3. vLLM's own LlavaNext processor, offline, with our general plugin.
# --------------------------------------------------------------------------

VLLM_PROCESSOR_SCRIPT = textwrap.dedent('''
    import json, sys
    import numpy as np, torch
    from PIL import Image
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    from vllm.engine.arg_utils import EngineArgs
    # EngineArgs loads the general plugins (our shims), as every vLLM entry does.
    args = EngineArgs(model=model_dir, dtype="float32", max_model_len=2048, seed=0)
    model_config = args.create_model_config()
    from vllm.multimodal import MULTIMODAL_REGISTRY
    processor = MULTIMODAL_REGISTRY.create_processor(model_config)
    tokenizer = processor.info.get_tokenizer()
    images = [Image.fromarray(np.random.default_rng(s).integers(0, 256, (h, w, 3), dtype=np.uint8))
              for s, (h, w) in enumerate(json.loads(sys.argv[3]))]
    # The prompt as vLLM's OpenAI chat path renders it (image_url parts).
    import base64, io
    from vllm.renderers.chat_utils.chat_message import parse_chat_messages
    from vllm.renderers.hf import resolve_chat_template_content_format
    def data_url(img):
        buf = io.BytesIO()
        img.save(buf, format="PNG")  # lossless
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content_format = resolve_chat_template_content_format(
        None, None, "auto", tokenizer, model_config=model_config)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(img)}} for img in images]
        + [{"type": "text", "text": "Describe."}]}]
    conversation, mm_data, _ = parse_chat_messages(messages, model_config, content_format)
    prompt = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                           tokenize=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    out = processor(ids, processor.info.parse_mm_data({"image": images}))
    items = out["mm_kwargs"]["image"]
    fields = {name: {"field": type(elem.field).__name__,
                     "keep_on_cpu": getattr(elem.field, "keep_on_cpu", None),
                     "shape": list(elem.data.shape), "dtype": str(elem.data.dtype)}
              for name, elem in items[0].items()}
    torch.save({"pixel_values": [it["pixel_values"].data for it in items],
                "image_sizes": [it["image_sizes"].data for it in items]}, out_dir + "/mm.pt")
    try:
        args.create_engine_config()
        engine_config_error = None
    except Exception as e:
        engine_config_error = str(e)
    print("RESULT " + json.dumps({
        "processor": type(processor).__name__,
        "content_format": content_format,
        "prompt": prompt,
        "prompt_len": len(ids),
        "prompt_token_ids": out["prompt_token_ids"],
        "placeholders": [[p.offset, p.length, p.is_embed is None]
                         for p in out["mm_placeholders"]["image"]],
        "fields": fields,
        "engine_config_error": engine_config_error,
    }))
''')


@pytest.fixture(scope="module")
def vllm_processed(ckpt, tmp_path_factory):
    """vLLM's processor for two images, run in a fresh process (vLLM's
    platform detection and plugin loading happen once per process)."""
    sizes = [(50, 80), (150, 60)]
    out_dir = tmp_path_factory.mktemp("vllm-processed")
    env = dict(os.environ, VLLM_PLUGINS="accel", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [PYTHON, "-c", VLLM_PROCESSOR_SCRIPT, str(ckpt), str(out_dir), json.dumps(sizes)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(lines[-1][len("RESULT "):])
    result["tensors"] = torch.load(out_dir / "mm.pt")
    result["sizes"] = sizes
    return result


@no_torchvision
def test_vllm_processor_matches_hf(vllm_processed, processor):
    r = vllm_processed
    assert r["processor"] == "LlavaNextMultiModalProcessor"
    # vLLM sees the template iterate over content parts ("openai" format) and
    # renders image_url parts as {"type": "image"} -> "<image>\n".
    assert r["content_format"] == "openai"
    images = [_image(h, w, seed=s) for s, (h, w) in enumerate(r["sizes"])]
    parts = [*(["<image>"] * len(images)), "Describe."]
    assert r["prompt"] == processor.apply_chat_template(_chat(*parts), add_generation_prompt=True)
    enc = _hf_inputs(processor, images, *parts)
    hf_ids = enc["input_ids"][0].tolist()
    # Same expansion as HF's processor: 168 + 244 image tokens.
    assert r["prompt_token_ids"] == hf_ids
    assert r["prompt_len"] == len(hf_ids) - 168 - 244 + 2
    runs = []
    for i, tok in enumerate(hf_ids):
        if tok == IMAGE_TOKEN_ID and (i == 0 or hf_ids[i - 1] != IMAGE_TOKEN_ID):
            runs.append([i, 0, True])
        if tok == IMAGE_TOKEN_ID:
            runs[-1][1] += 1
    assert r["placeholders"] == runs == [[runs[0][0], 168, True], [runs[0][0] + 169, 244, True]]

    # Field names/layout the runner receives per image item.
    assert r["fields"] == {
        "pixel_values": {"field": "MultiModalBatchedField", "keep_on_cpu": False,
                         "shape": [4, 3, 64, 64], "dtype": "torch.float32"},
        "image_sizes": {"field": "MultiModalBatchedField", "keep_on_cpu": True,
                        "shape": [2], "dtype": "torch.int64"},
    }
    # Images processed together are padded to the most tiles among them (HF
    # pads pixel_values; vLLM keeps each item's padded slice): image 0 needs
    # base + 2 tiles but carries 4 patches, the last all zeros. The model
    # must take image_size_to_num_patches(image_sizes) patches per item.
    pv, sizes = r["tensors"]["pixel_values"], r["tensors"]["image_sizes"]
    assert [t.shape[0] for t in pv] == [4, 4]
    assert [s.tolist() for s in sizes] == [list(s) for s in r["sizes"]]
    assert torch.count_nonzero(pv[0][3]) == 0
    for i, t in enumerate(pv):
        torch.testing.assert_close(t, enc["pixel_values"][i], atol=0, rtol=0)


@no_torchvision
def test_vllm_config_is_accepted_by_our_platform(vllm_processed):
    """Building a VllmConfig runs AccelPlatform.check_and_update_config, which
    accepts LlavaNext."""
    assert vllm_processed["engine_config_error"] is None


# --------------------------------------------------------------------------
# The shims themselves, each in a fresh interpreter.
# --------------------------------------------------------------------------

def _run(code: str, *args: str) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([PYTHON, "-c", textwrap.dedent(code), *args], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


@no_torchvision
def test_shims_are_cheap_idempotent_and_alias_pixtral():
    out = _run('''
        import importlib, sys, time
        try:
            import transformers.models.pixtral.image_processing_pixtral
            raise SystemExit("expected the torchvision variant to fail")
        except ModuleNotFoundError as e:
            assert e.name == "torchvision", e
        for name in list(sys.modules):  # forget the failed attempt
            if name.startswith("transformers.models.pixtral"):
                del sys.modules[name]
        from vllm_accel.patches import apply_patches
        start = time.perf_counter()
        apply_patches(); apply_patches()
        assert time.perf_counter() - start < 0.05
        assert sum(type(f).__name__ == "ShimFinder" for f in sys.meta_path) == 1
        assert "transformers.models.pixtral.image_processing_pil_pixtral" not in sys.modules
        from transformers.models.pixtral.image_processing_pixtral import _num_image_tokens
        tv = sys.modules["transformers.models.pixtral.image_processing_pixtral"]
        pil = importlib.import_module("transformers.models.pixtral.image_processing_pil_pixtral")
        assert tv is pil and pil.__spec__.name == pil.__name__
        assert _num_image_tokens((30, 50), 16) == (2, 4)
        print("OK")
    ''')
    assert out.strip().endswith("OK")


@no_torchvision
def test_video_processor_stub_lets_qwen2_5_vl_processor_load(tmp_path):
    """Qwen2_5_VLProcessor.from_pretrained needs a video processor, which
    transformers only has with torchvision."""
    code = '''
        import json, pathlib, sys
        from transformers import Qwen2_5_VLConfig
        from vllm_accel.testing.tiny_models import build_tokenizer
        d = pathlib.Path(sys.argv[1])
        tok = build_tokenizer()
        tok.add_special_tokens({"extra_special_tokens": ["<|image_pad|>", "<|video_pad|>"]})
        tok.save_pretrained(d)
        Qwen2_5_VLConfig(
            text_config=dict(vocab_size=len(tok), hidden_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, intermediate_size=64),
            vision_config=dict(depth=1, hidden_size=32, out_hidden_size=64, num_heads=2,
                               intermediate_size=32),
        ).save_pretrained(d)
        (d / "preprocessor_config.json").write_text(json.dumps({
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2_5_VLProcessor",
            "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
            "min_pixels": 3136, "max_pixels": 200704}))
        from transformers import Qwen2_5_VLProcessor
        if sys.argv[2] == "shim":
            from vllm_accel.patches import apply_patches
            apply_patches()
        try:
            p = Qwen2_5_VLProcessor.from_pretrained(d)
        except Exception as e:
            print("FAILED", type(e).__name__)
            raise SystemExit(0)
        v = p.video_processor
        assert type(v).__name__ == "Qwen2VLVideoProcessor"
        assert (v.merge_size, v.patch_size, v.temporal_patch_size) == (2, 14, 2)
        assert v.size["longest_edge"] == 200704
        assert "merge_size" in v.valid_kwargs.__annotations__
        import pickle
        assert pickle.loads(pickle.dumps(v)).merge_size == 2
        assert type(p.image_processor).__name__ == "Qwen2VLImageProcessorPil"
        from PIL import Image
        enc = p(images=Image.new("RGB", (56, 56)), text="<|image_pad|>", return_tensors="pt")
        assert enc["image_grid_thw"].tolist() == [[1, 4, 4]]
        try:
            p(videos=[[Image.new("RGB", (56, 56))] * 2], text="<|video_pad|>")
            raise SystemExit("video processing should fail")
        except ImportError:
            pass
        print("LOADED")
    '''
    assert _run(code, str(tmp_path / "without"), "none").strip().endswith("FAILED ImportError")
    assert _run(code, str(tmp_path / "with"), "shim").strip().endswith("LOADED")
