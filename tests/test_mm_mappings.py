"""mm_mappings: the adapter lookup through the architecture table, and LlavaNextVisionAdapter on the tiny LlavaNext fixture
fed with items from vLLM's own multimodal processor, checked against HF
transformers' LlavaNextForConditionalGeneration. Offline and CPU only."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from vllm_accel.architectures import Architecture, by_model_type, load_object
from vllm_accel.forward_context import get_forward_context
from vllm_accel.multimodal.mm_mappings import vision_adapter_class
from vllm_accel.multimodal.encoder import (VisionEncoder, merge_embeddings, pack_first_fit,
                                           pack_least_padding)
from vllm_accel.multimodal.inputs import item_tensors, warmup_image
from vllm_accel.multimodal.mm_mappings.base import VisionAdapter
from vllm_accel.testing.fixtures import make_tiny_model

IMAGE_TOKEN_ID = 6
# (width, height): 1x2 tiles and not a multiple of the tile (80x50), 1x3
# (60x150), 1x1, 2x2, and a 3x1 with letterbox padding (200x70).
SIZES = [(80, 50), (60, 150), (64, 64), (128, 128), (200, 70)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_model("llava_next", tmp_path_factory.mktemp("llava_next") / "m")


@pytest.fixture(scope="module")
def hf_config(ckpt):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(ckpt)


def _model_config(hf_config, ckpt):
    """What an adapter reads of vLLM's ModelConfig."""
    return SimpleNamespace(hf_config=hf_config, model=str(ckpt), trust_remote_code=False,
                           max_model_len=2048)


def _fms_model(ckpt):
    from fms.models import get_model

    return get_model("hf_pretrained", model_path=str(ckpt), device_type="cpu",
                     data_type=torch.float32).eval()


@pytest.fixture(scope="module")
def utils(ckpt, hf_config):
    return vision_adapter_class(hf_config)(_model_config(hf_config, ckpt), _fms_model(ckpt))


@pytest.fixture(scope="module")
def hf_model(ckpt):
    from transformers import LlavaNextForConditionalGeneration

    return LlavaNextForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def vllm_process(ckpt):
    """images -> (prompt ids, per-image MultiModalKwargsItem, placeholders),
    from vLLM's LlavaNext processor on a chat prompt with those images."""
    from vllm_accel.patches import apply_patches

    apply_patches()  # before vLLM resolves LlavaNext (torchvision-free)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.multimodal import MULTIMODAL_REGISTRY

    model_config = EngineArgs(model=str(ckpt), dtype="float32", max_model_len=2048,
                              seed=0).create_model_config()
    processor = MULTIMODAL_REGISTRY.create_processor(model_config)
    tokenizer = processor.info.get_tokenizer()

    def run(images):
        content = [{"type": "image"}] * len(images) + [{"type": "text", "text": "Describe."}]
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                               add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        out = processor(ids, processor.info.parse_mm_data({"image": images}))
        return (out["prompt_token_ids"], list(out["mm_kwargs"]["image"]),
                list(out["mm_placeholders"]["image"]))

    return run


def _images(sizes):
    return [warmup_image(w, h, seed) for seed, (w, h) in enumerate(sizes)]


def _hf_image_features(hf_model, items):
    """HF's packed features per image (get_image_features + pack_image_features)."""
    out = []
    with torch.no_grad():
        for item in items:
            feats = hf_model.model.get_image_features(item["pixel_values"][None],
                                                      item["image_sizes"][None])
            out.append(feats.pooler_output[0])
    return out


# --------------------------------------------------------------------------


def test_registry(hf_config):
    from transformers import AutoConfig

    from vllm_accel.multimodal.mm_mappings.llava_next import LlavaNextVisionAdapter

    assert by_model_type("llava_next").vision_adapter.endswith(":LlavaNextVisionAdapter")
    assert vision_adapter_class(hf_config) is LlavaNextVisionAdapter
    assert vision_adapter_class(hf_config.text_config) is None  # granite: text only
    assert vision_adapter_class(AutoConfig.for_model("llama")) is None
    assert LlavaNextVisionAdapter.image_token_id(_model_config(hf_config, "")) == IMAGE_TOKEN_ID

    with pytest.raises(ValueError, match="module:name"):
        load_object("no_colon")
    not_an_adapter = Architecture(("MyVLM",), "my_vlm",
                                  vision_adapter="vllm_accel.multimodal.inputs:warmup_image")
    with mock.patch("vllm_accel.multimodal.mm_mappings.by_model_type",
                    return_value=not_an_adapter):
        with pytest.raises(TypeError, match="not a VisionAdapter"):
            vision_adapter_class(type("Cfg", (), {"model_type": "my_vlm"}))

    # Importing the package loads no mapping (nor torch/FMS/vLLM).
    code = ("import sys, vllm_accel.multimodal.mm_mappings\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'fms', 'vllm', 'transformers') or 'mm_mappings.' in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ), check=True).stdout
    assert out.strip() == "[]"


def test_utils_basics(utils, hf_config):
    assert isinstance(utils, VisionAdapter)
    text = utils.text_model
    assert text is utils.fms_model.language_model
    assert text.config.nlayers == hf_config.text_config.num_hidden_layers
    assert hasattr(text, "base_model") and hasattr(text, "head")
    # 1 base tile + 1, 2, 2, 4, 3, 3 grid tiles.
    # Tile counts 2, 3, 4, 5, thinned to at most 3 buckets (the largest kept).
    assert utils.vision_buckets() == [2, 4, 5]
    assert utils.warmup_image_sizes(utils.vision_buckets()) == [
        (64, 64), (128, 64), (192, 64), (128, 128)]


def test_encode_vllm_items_equals_hf(utils, hf_model, vllm_process, ckpt):
    """One image per prompt: lengths equal vLLM's placeholders, features HF's;
    the HF processor (warmup_items) yields the same items as vLLM's."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec

    warm = utils.warmup_items(SIZES)
    for size, image, warm_item in zip(SIZES, _images(SIZES), warm):
        ids, items, placeholders = vllm_process([image])
        # What the runner finds in CachedRequestState.mm_features.
        spec = MultiModalFeatureSpec(data=items[0], modality="image", identifier="h",
                                     mm_position=placeholders[0])
        item = item_tensors(spec.data)
        assert set(item) == {"pixel_values", "image_sizes"}
        assert item["image_sizes"].tolist() == [size[1], size[0]]  # (height, width)
        for key in item:
            torch.testing.assert_close(item[key], warm_item[key], atol=0, rtol=0)

        feats = utils.encode_item(item)
        (hf_feats,) = _hf_image_features(hf_model, [item])
        assert len(placeholders) == 1 and placeholders[0].is_embed is None
        assert feats.shape == (placeholders[0].length, 256), size
        assert ids.count(IMAGE_TOKEN_ID) == placeholders[0].length
        torch.testing.assert_close(feats, hf_feats, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="no data"):
        item_tensors(None)


@pytest.mark.parametrize("sizes", [[(80, 50)], [(80, 50), (60, 150)]])
def test_merged_embeddings_equal_hf(utils, hf_model, vllm_process, sizes):
    ids, items, placeholders = vllm_process(_images(sizes))
    items = [item_tensors(it) for it in items]
    if len(sizes) == 2:
        # vLLM pads the images of a request to the most tiles: 80x50 needs 3.
        assert [it["pixel_values"].shape[0] for it in items] == [4, 4]
        assert torch.count_nonzero(items[0]["pixel_values"][3]) == 0

    is_mm = torch.zeros(len(ids), dtype=torch.bool)
    for p in placeholders:
        is_mm[p.offset:p.offset + p.length] = True
    input_ids = torch.tensor([ids])
    # Placeholders cover exactly the image tokens (newline positions included).
    assert torch.equal(is_mm, input_ids[0] == IMAGE_TOKEN_ID)

    encoder = VisionEncoder(utils)
    feats = encoder.encode(items)
    assert encoder.images_encoded == len(sizes)
    assert [f.shape[0] for f in feats] == [p.length for p in placeholders]
    with torch.inference_mode():
        merged = merge_embeddings(utils.embed_tokens(input_ids), torch.cat(feats), is_mm)

    captured = {}

    def grab(module, args, kwargs):
        captured["embeds"] = kwargs["inputs_embeds"]

    hook = hf_model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            hf_model(input_ids=input_ids,
                     pixel_values=torch.stack([it["pixel_values"] for it in items]),
                     image_sizes=torch.stack([it["image_sizes"] for it in items]))
    finally:
        hook.remove()
    assert merged.shape == captured["embeds"].shape == (1, len(ids), 256)
    torch.testing.assert_close(merged, captured["embeds"], atol=1e-5, rtol=1e-5)

    with pytest.raises(ValueError, match="placeholder positions"):
        merge_embeddings(merged, torch.cat(feats)[1:], is_mm)


def test_padding_tiles_changes_nothing(utils, ckpt):
    """SigLIP encodes tiles independently: zero tiles appended to a batch leave
    the real tiles' outputs (every hidden state) unchanged."""
    (item,) = utils.warmup_items([(80, 50)])
    pixels = item["pixel_values"]
    padded = torch.cat([pixels, torch.zeros(2, *pixels.shape[1:])])
    tower = utils.fms_model.vision_tower
    with torch.inference_mode():
        _, _, hidden = tower(pixels, output_hidden_states=True)
        _, _, hidden_padded = tower(padded, output_hidden_states=True)
    for h, hp in zip(hidden, hidden_padded):
        torch.testing.assert_close(hp[: len(pixels)], h, atol=1e-6, rtol=1e-6)


def test_compiled_encode(ckpt, hf_config, utils):
    """Inductor with coarse buckets [3, 5]: images are packed (first fit) into
    calls of at most 5 tiles, each padded to the smallest bucket that fits.
    One graph per bucket, none after; packed images encode as they do alone."""
    from torch._dynamo.utils import counters

    compiled_utils = vision_adapter_class(hf_config)(_model_config(hf_config, ckpt),
                                                     _fms_model(ckpt))
    compiled = VisionEncoder(compiled_utils, "inductor", "3,5")
    assert compiled.buckets == [3, 5] and compiled.batch_rows == 5
    sizes = [(80, 50), (64, 64), (60, 150), (128, 128)]  # 3, 2, 4, 5 tiles
    items = compiled_utils.warmup_items(sizes)
    assert [it["pixel_values"].shape[0] for it in items] == [3, 2, 4, 5]

    graphs = counters["stats"]["unique_graphs"]
    out = compiled.encode(items[:2])  # 3 + 2 tiles: one call, bucket 5
    assert compiled.calls == 1 and counters["stats"]["unique_graphs"] - graphs == 1
    out += compiled.encode(items[2:])  # 4 + 5 tiles: two calls, bucket 5
    assert compiled.calls == 3 and counters["stats"]["unique_graphs"] - graphs == 1
    compiled.encode(items[1:2])  # 2 tiles: bucket 3
    assert counters["stats"]["unique_graphs"] - graphs == 2
    again = compiled.encode(items)
    assert counters["stats"]["unique_graphs"] - graphs == 2  # no recompiles
    assert compiled.images_encoded == 2 * len(items) + 1
    assert compiled.calls == 3 + 1 + 3

    alone = [utils.encode_item(item) for item in items]  # eager, one image a call
    for c, c2, e in zip(out, again, alone):
        assert c.shape == e.shape
        torch.testing.assert_close(c, e, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c2, c, atol=0, rtol=0)


def test_packing_buckets_past_the_largest_image(ckpt, hf_config, utils):
    """An adapter whose budget outgrows its largest image (Qwen2.5-VL's full
    size: 1024-patch images, a 7,690-row budget) gets doublings of the largest
    bucket: small images share one call instead of padding one by one. Warmup
    compiles each (packed copies of the largest image for the new ones), and
    packed images encode as they do alone."""
    from torch._dynamo.utils import counters

    class Roomy(vision_adapter_class(hf_config)):
        def vision_batch_rows(self, buckets):
            return 2 * buckets[-1] + 1

    adapter = Roomy(_model_config(hf_config, ckpt), _fms_model(ckpt))
    encoder = VisionEncoder(adapter, "inductor")
    largest = encoder.image_buckets[-1]
    assert encoder.buckets == [*encoder.image_buckets, 2 * largest]
    assert encoder.batch_rows == 2 * largest

    sizes = adapter.warmup_image_sizes(encoder.image_buckets)
    groups = encoder.warmup_groups(adapter.warmup_items(sizes))
    rows = [sum(adapter.vision_rows(i) for i in g) for g in groups]
    assert rows[-1] == 2 * largest and max(rows[:-1]) == largest
    graphs = counters["stats"]["unique_graphs"]
    for group in groups:
        encoder.encode(group)
    assert counters["stats"]["unique_graphs"] - graphs == len(encoder.buckets)

    # 3 + 3 + 4 tiles: one call of 10 pads least (alone: 4 + 4 + 4).
    items = adapter.warmup_items([SIZES[0], SIZES[0], SIZES[1]])
    calls = encoder.calls
    packed = encoder.encode(items)
    assert encoder.calls == calls + 1
    assert counters["stats"]["unique_graphs"] - graphs == len(encoder.buckets)  # no recompiles
    for got, item in zip(packed, items):
        torch.testing.assert_close(got, utils.encode_item(item), atol=1e-5, rtol=1e-5)


QWEN_BUCKETS = [256, 512, 1024, 2048, 4096]


@pytest.mark.parametrize("rows, groups, padded", [
    # Seven 576-patch images: one call of 4,096 rows, not seven of 1,024.
    ([576] * 7, [list(range(7))], 4096),
    # A step's 3,272 rows: four calls of up to 1,024 pad to 3,584, one call to 4,096.
    ([512, 512, 324, 576, 512, 512, 324], [[0, 1], [2, 3], [4, 5], [6]], 3584),
    ([900], [[0]], 1024),
    ([], [], 0),
])
def test_pack_least_padding(rows, groups, padded):
    got = pack_least_padding(rows, QWEN_BUCKETS, 4096)
    assert got == groups
    assert sum(next(b for b in QWEN_BUCKETS if b >= sum(rows[i] for i in g)) for g in got) == padded


@pytest.mark.parametrize("rows, budget, groups", [
    ([3, 2, 4, 5], 5, [[0, 1], [2], [3]]),
    ([3, 4, 2, 5, 1], 5, [[0, 2], [1, 4], [3]]),  # a later image fills an earlier call
    ([1, 1, 1], 2, [[0, 1], [2]]),
    ([7, 1], 5, [[0], [1]]),  # over the budget: alone
    ([], 5, []),
])
def test_pack_first_fit(rows, budget, groups):
    assert pack_first_fit(rows, budget) == groups


class _RowsSeen(torch.nn.Module):
    """A vision module that records how many rows ops would compute."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Identity()  # the compiled unit
        self.seen, self.fail = [], False

    def forward(self, x):
        self.seen.append(get_forward_context().rows_to_compute(x.shape[0]))
        if self.fail:
            raise RuntimeError("a failing call")
        return self.layer(x) + 1


@pytest.mark.parametrize("rows_last", [False, True], ids=["rows_unknown", "rows_last"])
def test_ops_skip_the_padding_rows_during_the_call_only(rows_last):
    """An adapter whose padding rows stay last (vision_padding_rows_last) has
    ops compute only the real rows of its module's padded inputs, during the
    call, and not after it, even one that raised; any other, every row."""
    tower = _RowsSeen()
    adapter = SimpleNamespace(
        vision_buckets=lambda: [4, 8], vision_bucket_multiple=1,
        vision_batch_rows=lambda buckets: 8, vision_compile_units=lambda: [tower.layer],
        vision_graphs_per_bucket=1, vision_module=tower, vision_padded_args=1,
        vision_padding_rows_last=rows_last, vision_rows=lambda item: item.shape[0],
        encode_items=lambda items: list(tower(torch.cat(items)).split(
            [item.shape[0] for item in items])))
    encoder = VisionEncoder(adapter, "eager")
    (out,) = encoder.encode([torch.zeros(5, 2)])
    assert torch.equal(out, torch.ones(5, 2))
    assert tower.seen == [5 if rows_last else 8]
    assert get_forward_context().rows_to_compute(8) == 8
    tower.fail = True
    with pytest.raises(RuntimeError, match="a failing call"):
        encoder.encode([torch.zeros(3, 2)])
    assert tower.seen[-1] == (3 if rows_last else 4)
    assert get_forward_context().rows_to_compute(4) == 4


def test_bfloat16_tower_attends_by_the_kernel(ckpt, hf_config, utils, tmp_path, monkeypatch,
                                             with_bfloat16):
    """In bfloat16 on the CPU SigLIP's layers attend by our kernel, compiled
    too; against the float32 tower as close as with FMS's SDPA."""
    from helpers import in_forward
    from vllm_accel.kernels import span_attention

    kernel = with_bfloat16(span_attention.load(tmp_path))
    half = vision_adapter_class(hf_config)(_model_config(hf_config, ckpt),
                                           _fms_model(ckpt).to(torch.bfloat16))
    items = utils.warmup_items([(80, 50), (128, 128)])
    half_items = [{**it, "pixel_values": it["pixel_values"].bfloat16()} for it in items]
    layers = len(half.vision_compile_units())
    with torch.inference_mode():
        reference = torch.cat(utils.encode_items(items))
        calls = kernel.calls
        compiled = VisionEncoder(half, "inductor", "3,5")
        with in_forward(span=kernel):
            by_kernel = torch.cat(compiled.encode(half_items)).float()
        assert kernel.calls - calls == layers * compiled.calls
        by_sdpa = torch.cat(half.encode_items(half_items)).float()  # no kernel outside a forward
    kernel_error, sdpa_error = ((out - reference).abs() for out in (by_kernel, by_sdpa))
    assert kernel_error.mean() <= 1.2 * sdpa_error.mean()
    assert kernel_error.max() < 0.1 * reference.abs().max()
