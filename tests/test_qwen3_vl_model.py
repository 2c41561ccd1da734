"""The Qwen3-VL model port (vllm_accel/model/qwen3_vl*.py over our Qwen2
decoder) against HF transformers' Qwen3VLForConditionalGeneration on the
tiny offline checkpoint, float32 on CPU: the vision tower (merger and each
DeepStack feature), its padding, the interleaved M-RoPE table, prompt
positions, prompt logits and greedy tokens, weight loading.

Model level only: no vLLM engine. The FMS side runs the full-recompute
greedy loop of port_helpers (vision tower once, image rows and their
DeepStack features merged into wide embeddings) through
``language_model.base_model`` with FMS's default SDPA attention.
"""

from __future__ import annotations

import pytest
import torch

from port_helpers import (assert_greedy_matches_hf, fms_logits, image, load_port_model,
                          processed, prompt_positions)
from vllm_accel.model.qwen2_layers import Qwen2Rotary
from vllm_accel.model.qwen3_vl import FMS_PORT
from vllm_accel.testing.tiny_qwen3_vl import DEEPSTACK_INDEXES, HIDDEN
from vision_cases import QWEN3_VL, hf, model_dir  # noqa: F401 (hf, model_dir: fixtures)

# Observed max |diff| ~1e-5 on logits of magnitude ~7 (fused q/k/v and
# gate/up matmuls, the patch embedding as a linear, not a Conv3d).
LOGITS_ATOL = 1e-4
FEATURES_ATOL = 1e-5
SIZES = list(QWEN3_VL.sizes)  # (width, height)
CASES = {
    **{f"{w}x{h}": [(w, h)] for w, h in SIZES},
    "two_images": [(224, 224), (300, 200)],
    "text_only": [],
}


@pytest.fixture(scope="module")
def arch():
    return QWEN3_VL


@pytest.fixture(scope="module")
def fms(model_dir):
    return load_port_model(FMS_PORT, model_dir)  # raises if any weight stayed unloaded


@torch.no_grad()
def test_vision_tower_and_deepstack_features_match_hf(hf, fms):
    processor, hf_model = hf
    inputs = processed(processor, [image(w, h) for w, h in SIZES])
    want = hf_model.model.visual(inputs.pixel_values, grid_thw=inputs.image_grid_thw)
    got = fms.visual(inputs.pixel_values, inputs.image_grid_thw.tolist())
    parts = got.split(HIDDEN, dim=-1)
    assert len(parts) == 1 + len(DEEPSTACK_INDEXES) == 1 + len(want.deepstack_features)
    torch.testing.assert_close(parts[0], want.pooler_output, atol=FEATURES_ATOL, rtol=0)
    for ours, theirs in zip(parts[1:], want.deepstack_features):
        torch.testing.assert_close(ours, theirs, atol=FEATURES_ATOL, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("pad", [4, 64])
def test_vision_padding_is_invisible(hf, fms, pad):
    processor, _ = hf
    inputs = processed(processor, [image(300, 200), image(449, 97)])
    grid = inputs.image_grid_thw.tolist()
    plain = fms.visual(inputs.pixel_values, grid)
    padded = torch.cat([inputs.pixel_values, torch.randn(pad, inputs.pixel_values.shape[1])])
    assert torch.equal(fms.visual(padded, grid), plain)


def test_interleaved_mrope_table_matches_hf(hf, fms):
    """Our rotary's cos/sin for 3-D positions equal HF's text rotary (which
    interleaves the t, h, w frequencies)."""
    _, hf_model = hf
    config = fms.config.text_config
    positions = torch.randint(0, 500, (3, 1, 9))
    rotary = Qwen2Rotary(config.head_dim, config.rope_theta, config.mrope_section,
                         config.mrope_interleaved)
    cos, sin = rotary.cos_sin(positions, torch.float32)
    hf_cos, hf_sin = hf_model.model.language_model.rotary_emb(torch.zeros(1), positions)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)


@pytest.mark.parametrize("sizes", [[(300, 200)], [(224, 224), (1000, 60)]])
def test_mrope_positions_match_hf_get_rope_index(hf, fms, sizes):
    processor, hf_model = hf
    inputs = processed(processor, [image(w, h) for w, h in sizes])
    want, want_delta = hf_model.model.get_rope_index(
        inputs.input_ids, inputs.mm_token_type_ids, image_grid_thw=inputs.image_grid_thw)
    got, delta = prompt_positions(fms, inputs.input_ids[0].tolist(),
                                  inputs.image_grid_thw.tolist())
    assert torch.equal(got, want[:, 0]) and delta == int(want_delta)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_match_hf(hf, fms, case):
    assert_greedy_matches_hf(hf, fms, [image(w, h) for w, h in CASES[case]], LOGITS_ATOL)


@torch.no_grad()
def test_deepstack_features_steer_the_decoder(hf, fms):
    """Without the DeepStack columns (zeroed) the prompt logits move: the
    features reach the decoder (and HF's logits are matched only with them)."""
    processor, _ = hf
    inputs = processed(processor, [image(300, 200)])
    grid = inputs.image_grid_thw.tolist()
    ids = inputs.input_ids[0].tolist()
    positions, _ = prompt_positions(fms, ids, grid)
    features = fms.visual(inputs.pixel_values, grid)
    without = features.clone()
    without[:, HIDDEN:] = 0
    assert not torch.allclose(fms_logits(fms, ids, features, positions),
                              fms_logits(fms, ids, without, positions), atol=1e-3)


def test_fixture_is_deterministic(model_dir, tmp_path):
    again = QWEN3_VL.make(tmp_path / "again")
    for name in ("model.safetensors", "config.json", "preprocessor_config.json",
                 "video_preprocessor_config.json", "tokenizer.json"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name


@pytest.mark.parametrize("max_model_len,largest", [(4096, 256), (40, 160)])
def test_vision_buckets_stop_at_what_max_model_len_admits(model_dir, fms, max_model_len,
                                                          largest):
    """The tiny processor's largest image is 256 patches (64 tokens); a
    40-token model admits no image past 160 patches, so warmup compiles no
    bucket beyond it (real checkpoints allow 4096x4096 images: 65,536
    patches, minutes of warmup for images no prompt could hold)."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from vllm_accel.multimodal.mm_mappings import vision_adapter_class

    hf_config = AutoConfig.from_pretrained(model_dir)
    model_config = SimpleNamespace(hf_config=hf_config, model=str(model_dir),
                                   trust_remote_code=False, max_model_len=max_model_len)
    adapter = vision_adapter_class(hf_config)(model_config, fms)
    buckets = adapter.vision_buckets()
    assert buckets[-1] == largest
    (width, height), = adapter.warmup_image_sizes(buckets[-1:])
    assert (width // 32) * (height // 32) * 4 <= largest
