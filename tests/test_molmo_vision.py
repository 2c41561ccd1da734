"""Our Molmo vision side (vllm_accel.model.molmo) against vLLM's own Molmo
vision backbone, same fixture weights, on images processed by vLLM's Molmo
processing; crop-axis padding; torch.compile of the ViT block."""

from __future__ import annotations


import pytest
import torch
from molmo_reference import (
    build_vllm_molmo,
    image,
    molmo_checkpoint,
    vllm_config,
    vllm_processor,
)
from safetensors.torch import load_file

from port_helpers import image_embeddings, load_hf_vision_weights, pad_crops
from vllm_accel.model.molmo import MolmoVisionBackbone, MolmoVisionConfig, image_embed_order
from vllm_accel.testing.tiny_molmo import MAX_CROPS

# float32. Observed: bit-identical to vLLM on CPU (same ops in the same order);
# the tolerance leaves room for other kernels (fused qkv, other SDPA backends).
ATOL = 1e-5
SIZES = [(40, 40), (112, 80), (30, 120), (640, 480), (12, 20)]  # 2, 7, 5, 7, 2 crops


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return molmo_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def vllm_model(ckpt):
    model, _, _ = build_vllm_molmo(ckpt)
    return model


@pytest.fixture(scope="module")
def ours(ckpt):
    from transformers import AutoConfig

    config = MolmoVisionConfig.from_hf_config(AutoConfig.from_pretrained(ckpt,
                                                                        trust_remote_code=True))
    backbone = MolmoVisionBackbone(config)
    load_hf_vision_weights(backbone, load_file(ckpt / "model.safetensors"))
    return backbone.eval()


@pytest.fixture(scope="module")
def items(ckpt):
    """Per size: vLLM's processed item (images, image_masks, image_input_idx,
    num_crops, img_patch_id), from a one-image prompt."""
    processor, tokenizer = vllm_processor(vllm_config(ckpt))
    ids = tokenizer.encode("User: Describe. Assistant:", add_special_tokens=False)
    out = {}
    for i, (w, h) in enumerate(SIZES):
        result = processor(ids, processor.info.parse_mm_data({"image": [image(w, h, i)]}))
        (item,) = result["mm_kwargs"]["image"]
        out[(w, h)] = {k: v.data for k, v in item.items()}
    return out


def test_config_from_fixture(ours):
    cfg = ours.config
    assert (cfg.crop_size, cfg.patch_size, cfg.emb_dim, cfg.nheads, cfg.nlayers) == (
        (48, 48), 4, 64, 4, 9)
    assert (cfg.text_dim, cfg.projector_dim, cfg.tokens_per_crop) == (256, 512, 36)
    assert cfg.layers_run == 8  # layer -2 is the deepest used: block 8 is not built
    assert len(ours.image_vit.transformer.resblocks) == 8


def test_full_size_defaults():
    """Without the fixture's vision_backbone_config: Molmo-7B's tower."""
    from types import SimpleNamespace

    cfg = MolmoVisionConfig.from_hf_config(SimpleNamespace(hidden_size=3584,
                                                           intermediate_size=37888))
    assert (cfg.crop_size, cfg.patch_size, cfg.emb_dim, cfg.nlayers, cfg.num_pos) == (
        (336, 336), 14, 1024, 23, 577)
    assert (cfg.tokens_per_crop, cfg.projector_dim, cfg.layers_run) == (144, 18944, 22)


def test_weights_every_parameter(ckpt, ours):
    """Every parameter comes from the checkpoint; only the unused last ViT
    block's keys are left over."""
    sd = load_file(ckpt / "model.safetensors")
    vision_keys = {k for k in sd if k.startswith("model.vision_backbone.")}
    ours_keys = {"model.vision_backbone." + k for k, _ in ours.named_parameters()}
    assert ours_keys <= vision_keys
    assert {k.split(".")[5] for k in vision_keys - ours_keys} == {"8"}
    for name, p in ours.named_parameters():
        assert torch.equal(p, sd["model.vision_backbone." + name]), name


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_matches_vllm(vllm_model, ours, items, size):
    item = items[size]
    with torch.no_grad():
        (expected,) = vllm_model.embed_multimodal(
            images=item["images"], image_masks=item["image_masks"],
            image_input_idx=item["image_input_idx"], num_crops=item["num_crops"][None],
            img_patch_id=item["img_patch_id"])
        per_crop_ref = vllm_model.vision_backbone(item["images"][None],
                                                  item["image_masks"][None])[0]
        per_crop = ours(item["images"], item["image_masks"])
        got = image_embeddings(ours, item["images"], item["image_masks"],
                               item["image_input_idx"])
    assert per_crop.shape == per_crop_ref.shape == (item["images"].shape[0], 36, 256)
    torch.testing.assert_close(per_crop, per_crop_ref, atol=ATOL, rtol=0)
    assert got.shape == expected.shape == (int((item["image_input_idx"] >= 0).sum()), 256)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("size", [(40, 40), (30, 120)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_padded_crops_give_identical_rows(ours, items, size):
    item = items[size]
    images, masks, idx = item["images"], item["image_masks"], item["image_input_idx"]
    with torch.no_grad():
        real = ours(images, masks)
        padded = ours(*pad_crops(images, masks, idx, MAX_CROPS + 1)[:2])
        rows = image_embed_order(pad_crops(images, masks, idx, MAX_CROPS + 1)[2])
    assert padded.shape[0] == MAX_CROPS + 1
    assert torch.equal(padded[: images.shape[0]], real)
    assert torch.equal(rows, image_embed_order(idx))  # padding crops give no rows
    with pytest.raises(ValueError, match="do not fit"):
        pad_crops(images, masks, idx, images.shape[0] - 1)


def test_vit_block_compiles(ours, items):
    block = ours.image_vit.transformer.resblocks[0]
    x = torch.randn(MAX_CROPS + 1, 145, 64, generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), block(x), atol=ATOL, rtol=0)


@pytest.mark.slow
def test_backbone_compiles(ours, items):
    """The whole per-crop path (ViT, pad embeddings, pooling, projector) is
    one graph for a fixed crop bucket."""
    item = items[(30, 120)]
    images, masks, _ = pad_crops(item["images"], item["image_masks"],
                                 item["image_input_idx"], MAX_CROPS + 1)
    compiled = torch.compile(ours, fullgraph=True, dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(images, masks), ours(images, masks),
                                   atol=ATOL, rtol=0)


def test_bfloat16_attention_as_accurate_as_sdpa(vllm_model, ours, items, monkeypatch, tmp_path,
                                                with_bfloat16):
    """In bfloat16 on the CPU the ViT attends by our kernel (span_attention)
    where it runs the dtype (else by torch's SDPA): against vLLM's float32
    backbone as close as bfloat16 SDPA is."""
    import copy

    from helpers import in_forward
    from vllm_accel.kernels import span_attention

    kernel = with_bfloat16(span_attention.load(tmp_path))
    calls = kernel.calls
    item = items[(640, 480)]
    half = copy.deepcopy(ours).to(torch.bfloat16)
    with torch.no_grad():
        reference = vllm_model.vision_backbone(item["images"][None], item["image_masks"][None])[0]
        with in_forward(span=kernel):
            error = (half(item["images"], item["image_masks"]).float() - reference).abs()
        # one call per ViT layer
        assert kernel.calls - calls == len(half.image_vit.transformer.resblocks)
        sdpa_error = (half(item["images"], item["image_masks"]).float() - reference).abs()
    assert error.max() < 0.1 * reference.abs().max()
    assert error.mean() <= 1.2 * sdpa_error.mean()
