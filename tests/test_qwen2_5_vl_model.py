"""The Qwen2.5-VL model port (vllm_accel/model/qwen2*.py, qwen2_5_vl*.py) against
HF transformers' Qwen2_5_VLForConditionalGeneration on the tiny offline
checkpoint, float32 on CPU: logits, greedy tokens, vision tower padding,
M-RoPE positions, weight loading and torch.compile of the blocks.

Model level only: no vLLM engine. The FMS side runs a plain full-recompute
greedy loop (vision tower once, prompt positions from ``mrope_positions``,
decode positions i + delta) through ``language_model.base_model`` with FMS's
default SDPA attention.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from helpers import in_forward
from vllm_accel.kernels import span_attention
from vllm_accel.model.fms_causal_lm import check_all_weights_loaded, _load_with_nan_fill
from port_helpers import (assert_greedy_matches_hf, fms_generate, image, load_port_model,
                          merge_image_features, processed, prompt_positions, qwen2_registered)
from vllm_accel.model.qwen2_5_vl import FMS_PORT
from vllm_accel.model.qwen2_5_vl_vision import vision_layout
from vllm_accel.patches import apply_patches
from vllm_accel.testing.tiny_qwen2_5_vl import make_tiny_qwen2_5_vl

# Observed max |diff| ~5e-5 on logits of magnitude ~10 (different reduction
# orders: fused q/k/v and gate/up matmuls, one masked SDPA vs per-window SDPA).
LOGITS_ATOL = 1e-4
SIZES = [(224, 224), (300, 200), (449, 97), (1000, 60)]  # (width, height)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    apply_patches()  # stand-in video processor: AutoProcessor works without torchvision
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl") / "tiny", seed=0)


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(ckpt)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32)
    return processor, model.eval()


def load_fms(path):
    return load_port_model(FMS_PORT, path)


@pytest.fixture(scope="module")
def fms(ckpt):
    return load_fms(ckpt)


CASES = {
    **{f"{w}x{h}": [(w, h)] for w, h in SIZES},
    "two_images": [(224, 224), (300, 200)],
    "text_only": [],
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_match_hf(hf, fms, case):
    assert_greedy_matches_hf(hf, fms, [image(w, h) for w, h in CASES[case]], LOGITS_ATOL)


def test_images_steer_the_output(hf, fms):
    """Guard against a silently ignored image: same prompt, different pixels."""
    processor, _ = hf
    tokens = [fms_generate(fms, processed(processor, [image(224, 224, seed)]))[1]
              for seed in (0, 1, 2)]
    assert len({tuple(t) for t in tokens}) > 1


@pytest.mark.parametrize("pad", [4, 20, 100])
def test_vision_padding_is_invisible(hf, fms, pad):
    processor, _ = hf
    inputs = processed(processor, [image(300, 200), image(449, 97)])
    pixels, grid = inputs.pixel_values, inputs.image_grid_thw
    noise = torch.randn(pad, pixels.shape[1], generator=torch.Generator().manual_seed(pad))
    with torch.no_grad():
        reference = fms.visual(pixels, grid)
        padded = fms.visual(torch.cat([pixels, 100 * noise]), grid)
    assert padded.shape == reference.shape
    torch.testing.assert_close(padded, reference, atol=1e-5, rtol=0)


def test_banded_attention_is_the_masked_attention(fms):
    """The window blocks' banded attention equals SDPA over the same mask
    written out densely: exactly in float32, and in bfloat16 no less
    accurate than SDPA (scores rounded to bfloat16 before the softmax were
    1.7x SDPA's error)."""
    import torch.nn.functional as F

    from vllm_accel.model.qwen2_5_vl_vision import banded_attention

    grid = [[1, 10, 14], [1, 6, 6]]  # 5x7 and 3x3 merged tokens: partial windows
    n = 140 + 36 + 12  # and padding rows
    layout = vision_layout(fms.config.vision_config, grid, n)
    band_mask = layout.window_mask
    chunks, band, _ = band_mask.shape
    dense = torch.zeros(chunks * band + 2 * band, chunks * band + 2 * band, dtype=torch.bool)
    for c in range(chunks):  # chunk c's keys are rows (c - 1) * band ... (c + 2) * band
        dense[band + c * band: band + (c + 1) * band, c * band: (c + 3) * band] = band_mask[c]
    dense = dense[band: band + n, band: band + n]
    assert dense.any(-1).all()  # every row sees at least itself
    # The kernel's spans of rows say the same (windows, and frames for the
    # full-attention blocks).
    keys = torch.arange(n)
    for mask, ranges in ((dense, layout.window_ranges), (layout.full_mask, layout.full_ranges)):
        assert torch.equal((keys >= ranges[:, :1]) & (keys < ranges[:, 1:]), mask)

    g = torch.Generator().manual_seed(0)
    q, k, v = (2 * torch.randn(n, 4, 80, generator=g) for _ in range(3))

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)),
                                              attn_mask=dense).transpose(0, 1)

    reference = sdpa(q, k, v)
    torch.testing.assert_close(banded_attention(q, k, v, band_mask), reference,
                               atol=5e-5, rtol=0)
    half = [t.bfloat16() for t in (q, k, v)]
    ours = (banded_attention(*half, band_mask).float() - reference).abs().mean()
    theirs = (sdpa(*half).float() - reference).abs().mean()
    assert ours <= 1.1 * theirs


def test_bfloat16_tower_attends_by_the_kernel(fms, tmp_path, monkeypatch, with_bfloat16):
    """In bfloat16 on the CPU every block attends by our kernel (spans of
    rows: windows, frames; images packed with padding): against the float32
    tower (masked SDPA) as close as the masked SDPA path in bfloat16."""
    kernel = with_bfloat16(span_attention.load(tmp_path))
    tower = fms.visual
    half = copy.deepcopy(tower).to(torch.bfloat16)
    grid = [[1, 10, 14], [1, 6, 6]]
    pixels = torch.randn(140 + 36 + 12, tower.config.patch_dim,
                         generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        calls = kernel.calls
        with in_forward(span=kernel):
            by_kernel = half(pixels.bfloat16(), grid).float()
        assert kernel.calls - calls == len(tower.layers)
        reference = tower(pixels, grid)
        by_sdpa = half(pixels.bfloat16(), grid).float()
    kernel_error, sdpa_error = ((out - reference).abs() for out in (by_kernel, by_sdpa))
    assert kernel_error.mean() <= 1.2 * sdpa_error.mean()
    assert kernel_error.max() < 0.1 * reference.abs().max()


def test_compiled_blocks_see_one_kind_of_call_whatever_the_pixels_dtype(fms):
    """vLLM hands the tower bfloat16 pixels where the warmup hands it the
    processor's float32 ones: the blocks' inputs (rotary tables included)
    must not change with them, or serving compiles new graphs."""
    from vllm_accel.model.compile import compile_shared_forward

    half = copy.deepcopy(fms.visual).to(torch.bfloat16)
    compile_shared_forward(list(half.layers), "eager", num_shapes=2)
    pixels = torch.randn(64, half.config.patch_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        from_float32 = half(pixels, [[1, 8, 8]])
        from_bfloat16 = half(pixels.bfloat16(), [[1, 8, 8]])
    assert torch.equal(from_float32, from_bfloat16)
    assert {layer.forward.guarded_calls for layer in half.layers} == {1}


def test_vision_padding_must_keep_merge_groups(fms):
    with pytest.raises(ValueError, match="multiple of 4"):
        vision_layout(fms.config.vision_config, [[1, 4, 4]], 16 + 2)


def test_vision_tower_matches_hf(hf, fms):
    processor, hf_model = hf
    inputs = processed(processor, [image(w, h) for w, h in SIZES])
    with torch.no_grad():
        ref = hf_model.model.visual(inputs.pixel_values, grid_thw=inputs.image_grid_thw).pooler_output
        ours = fms.visual(inputs.pixel_values, inputs.image_grid_thw)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("sizes", [[], [(300, 200)], [(224, 224), (1000, 60)]],
                         ids=["text", "one_image", "two_images"])
def test_mrope_positions_match_hf_get_rope_index(hf, fms, sizes):
    processor, hf_model = hf
    inputs = processed(processor, [image(w, h) for w, h in sizes], text="Describe it, then stop.")
    grid = inputs.image_grid_thw if sizes else None
    hf_positions, hf_delta = hf_model.model.get_rope_index(
        inputs.input_ids, inputs.mm_token_type_ids, image_grid_thw=grid)
    positions, delta = prompt_positions(fms, inputs.input_ids[0].tolist(),
                                        grid.tolist() if sizes else [])
    assert torch.equal(positions, hf_positions[:, 0])
    assert delta == int(hf_delta)


def test_every_weight_loaded_untied(tmp_path):
    """The default fixture ties lm_head to the embedding (no lm_head tensor);
    an untied checkpoint must load its lm_head too."""
    path = make_tiny_qwen2_5_vl(tmp_path / "untied", tie_word_embeddings=False)
    model = load_fms(path)  # raises if any weight stayed NaN
    lm = model.language_model
    assert lm.head.weight is not lm.base_model.embedding.weight
    assert not torch.equal(lm.head.weight, lm.base_model.embedding.weight)


def test_tied_head_is_the_embedding(fms):
    lm = fms.language_model
    assert lm.head.weight is lm.base_model.embedding.weight


def test_blocks_compile_fullgraph_like_eager(hf, fms):
    """Decoder and vision blocks through the runner's compile path: one
    inductor graph (fullgraph, static shapes) shared by all layers."""
    from torch._dynamo.utils import counters

    from vllm_accel.model.compile import compile_shared_forward

    torch._dynamo.reset()
    processor, _ = hf
    inputs = processed(processor, [image(224, 224)])
    ids = inputs.input_ids[:, :24]  # vision start + image tokens: M-RoPE positions differ per axis
    positions, _ = prompt_positions(fms, inputs.input_ids[0].tolist(), inputs.image_grid_thw.tolist())
    positions = positions[:, None, :24]

    text_layers = copy.deepcopy(fms.language_model.base_model.layers)
    x = fms.language_model.base_model.embedding(ids).detach()
    vision = fms.visual
    grid = [[1, 8, 8]]
    layout = vision_layout(vision.config, grid, 64 + 8)
    v = torch.randn(72, vision.config.emb_dim, generator=torch.Generator().manual_seed(0))
    attention = [(layout.full_mask, layout.full_ranges)
                 if i in vision.config.fullatt_block_indexes
                 else (layout.window_mask, layout.window_ranges)
                 for i in range(len(vision.layers))]

    def run_text(layers):
        h = x
        for layer in layers:
            h, _ = layer(h, position_ids=positions, use_cache=True)
        return h

    def run_vision(layers):
        h = v
        for layer, (mask, ranges) in zip(layers, attention):
            h = layer(h, layout.cos, layout.sin, mask, ranges)
        return h

    vision_layers = copy.deepcopy(vision.layers)
    with torch.no_grad():
        eager_text, eager_vision = run_text(text_layers), run_vision(vision_layers)
        compile_shared_forward(list(text_layers), "inductor", 1)
        compile_shared_forward(list(vision_layers), "inductor", 1)
        graphs_before = counters["stats"]["unique_graphs"]
        compiled_text, compiled_vision = run_text(text_layers), run_vision(vision_layers)
    # One graph for all text layers, one for both kinds of vision block: on
    # the CPU both attend by spans (our kernel, or torch's SDPA span by span
    # where it does not run), so the masks go unread. (A GPU's window blocks
    # attend in bands, its full-attention blocks under an [N, N] mask: two.)
    assert counters["stats"]["unique_graphs"] - graphs_before == 2
    torch.testing.assert_close(compiled_text, eager_text, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(compiled_vision, eager_vision, atol=1e-4, rtol=1e-4)


def test_paged_attention_plugs_in(hf, fms):
    """The interface the runner uses: base_model(..., use_cache=True,
    attn_name=paged) with [3, 1, T] positions gives the SDPA result."""
    from vllm_accel.model.paged_attention import (
        ATTN_NAME, PagedAttentionMetadata, PrefillChunk, causal_context_mask,
        register_paged_attention,
    )

    register_paged_attention()
    processor, _ = hf
    inputs = processed(processor, [image(300, 200)])
    ids = inputs.input_ids[0].tolist()
    positions, _ = prompt_positions(fms, ids, inputs.image_grid_thw.tolist())
    base = fms.language_model.base_model
    with torch.no_grad():
        embeds = merge_image_features(fms, inputs.input_ids, fms.visual(inputs.pixel_values,
                                                                       inputs.image_grid_thw))
        reference, _ = base(embeds, position_ids=positions[:, None], use_cache=True)

        block_size, tokens = 16, len(ids)
        blocks = torch.arange(1, 1 + -(-tokens // block_size))  # block 0 is never handed out
        c = fms.config.text_config
        caches = [(torch.zeros(8, block_size, c.kvheads, c.head_dim),
                   torch.zeros(8, block_size, c.kvheads, c.head_dim)) for _ in range(c.nlayers)]
        metadata = PagedAttentionMetadata(
            slot_mapping=blocks.repeat_interleave(block_size)[:tokens] * block_size
            + torch.arange(tokens) % block_size,
            num_decodes=0,
            decode_block_table=torch.zeros(0, 1, dtype=torch.long),
            decode_context_lens=torch.zeros(0, dtype=torch.long),
            prefills=[PrefillChunk(0, tokens, blocks[None], causal_context_mask(
                torch.arange(tokens)[None], torch.tensor([tokens]), len(blocks) * block_size),
                context_len=tokens)],
        )
        with in_forward(metadata):
            paged, _ = base(embeds, position_ids=positions[:, None],
                            past_key_value_states=caches, use_cache=True, attn_name=ATTN_NAME)
    torch.testing.assert_close(paged, reference, atol=1e-5, rtol=0)


def test_loads_module_key_layout(ckpt, fms, tmp_path):
    """Checkpoints keyed like transformers 5's modules (model.language_model.*,
    model.visual.*; some re-uploads use it) load like the hub layout."""
    import shutil

    from safetensors.torch import load_file, save_file

    def module_key(hub_key):
        if hub_key.startswith("visual."):
            return "model." + hub_key
        return re.sub(r"^model\.", "model.language_model.", hub_key)

    renamed = {module_key(k): t for k, t in load_file(ckpt / "model.safetensors").items()}
    assert any(k.startswith("model.visual.") for k in renamed)
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(ckpt / "config.json", tmp_path / "config.json")
    reloaded = load_fms(tmp_path)
    expected = fms.state_dict()
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_qwen2_text_model_matches_hf(tmp_path):
    """The decoder alone, as Qwen2ForCausalLM (1-D RoPE, untied head)."""
    from transformers import Qwen2Config as HFQwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = HFQwen2Config(vocab_size=320, hidden_size=256, intermediate_size=320,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=512, tie_word_embeddings=False)
    config.architectures = ["Qwen2ForCausalLM"]
    hf_model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf_model.parameters():
            p.normal_(0, 0.1)
    hf_model.save_pretrained(tmp_path)
    with qwen2_registered():
        model = _load_with_nan_fill(str(tmp_path), torch.float32, "cpu")
    check_all_weights_loaded(model, str(tmp_path))
    ids = torch.randint(0, 320, (1, 21))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, position_ids=torch.arange(21)[None]),
                                   hf_model(ids).logits, atol=LOGITS_ATOL, rtol=0)
