"""The vision-language architectures the tests compare with HF transformers,
one table entry each, and the module-scoped fixtures built from an entry.

A test module imports the fixtures it needs and defines ``arch`` (module
scope): parametrised over ``ARCHS`` in test_vision_parity.py, one entry in an
architecture's own test module. Each module then starts each engine once per
architecture."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

from helpers import chat_prompt, hf_vision_greedy, noise_image, running_llm
from vllm_accel.patches import apply_patches
from vllm_accel.testing.fixtures import make_tiny_model
from vllm_accel.testing.tiny_qwen2_5_vl import make_tiny_qwen2_5_vl
from vllm_accel.testing.tiny_qwen3_vl import make_tiny_qwen3_vl

MAX_TOKENS = 10
ENGINE = dict(max_model_len=1024, limit_mm_per_prompt={"image": 2}, max_num_seqs=8)

Size = tuple[int, int]  # (width, height)


@dataclass(frozen=True, eq=False)
class VisionArch:
    name: str  # the test id
    make: Callable[[Path], Path]  # writes the tiny checkpoint into a folder
    hf_class: str  # transformers' model class: the reference
    sizes: tuple[Size, ...]  # one image a case
    two_images: tuple[Size, Size]  # the two-image case
    # Chunked prefill: chunk_tokens-token chunks end inside chunk_image.
    chunk_tokens: int
    chunk_image: Size
    repeat_image: tuple[int, int, int]  # (width, height, seed): sent twice in one batch
    # Compiled serving (inductor): accel settings besides the backend and the
    # cache folder, max_num_batched_tokens, graphs compiled at warmup, and
    # the vision encoder's buckets where asserted.
    compile_settings: dict
    compile_batched_tokens: int
    warmup_graphs: int
    vision_buckets: list[int] | None = None
    # New images of all ``sizes`` in one batch: (images encoded, encoder calls).
    packed_batch: tuple[int, int] = (0, 0)
    # A later question about repeat_image whose image vLLM reports cached
    # (prefix cache / encoder cache), asserted not encoded again, where given.
    cached_followup: str | None = None
    patch_before_processor: bool = False  # apply_patches() before HF's processor loads
    engine: dict = field(default_factory=lambda: dict(ENGINE))


LLAVA_NEXT = VisionArch(
    name="llava_next",
    make=functools.partial(make_tiny_model, "llava_next"),
    hf_class="LlavaNextForConditionalGeneration",
    sizes=((80, 50), (60, 150), (64, 64), (128, 128), (200, 70)),
    two_images=((80, 50), (60, 150)),
    # 3, 4, 2, 5, 4 tiles, at most 5 (the largest bucket) a call: 3 + 2 share one.
    packed_batch=(5, 4),
    # The 80x50 image takes 168 placeholder tokens from offset 8: 48-token
    # chunks end inside it three times.
    chunk_tokens=48,
    chunk_image=(80, 50),
    repeat_image=(128, 64, 7),
    compile_settings={"token_buckets": "1,16,256,2048"},
    compile_batched_tokens=2048,
    # Decoder layers' and final norm's graphs (bucket 1; one shared by 16,
    # 256, 2048) + one for tile buckets 2, 4, 5.
    warmup_graphs=2 * 2 + 1,
    cached_followup="What colour dominates? Answer briefly.",
)

QWEN2_5_VL = VisionArch(
    name="qwen2_5_vl",
    make=make_tiny_qwen2_5_vl,
    hf_class="Qwen2_5_VLForConditionalGeneration",
    # Sizes that are and are not multiples of 28 and 112.
    sizes=((224, 224), (300, 200), (449, 97), (1000, 60)),
    two_images=((300, 200), (449, 97)),
    # 256, 216, 192, 128 patches against a 256-patch budget (the tiny tower's
    # attention outgrows its linear layers beyond 320 rows): a call each.
    packed_batch=(4, 4),
    # 300x200 -> 11x7 merged tokens = 77 image tokens from offset 4: 32-token
    # chunks end inside the image twice.
    chunk_tokens=32,
    chunk_image=(300, 200),
    repeat_image=(224, 224, 9),
    # Coarse vision buckets: every image here is padded (16..256 patches -> 64 or 256).
    compile_settings={"token_buckets": "16,256,1024", "multimodal_buckets": "64,256"},
    compile_batched_tokens=1024,
    # token buckets + vision buckets: on the cpu device window and
    # full-attention blocks both attend by spans (our kernel, or SDPA span by
    # span), so the masks go unread and one graph serves both kinds
    # The decoder layers', the final norm's and the tower's: each shared by its buckets.
    warmup_graphs=1 + 1 + 1,
    vision_buckets=[64, 256],
    patch_before_processor=True,  # the stand-in video processor (no torchvision)
)

MISTRAL3 = VisionArch(
    name="mistral3",
    make=functools.partial(make_tiny_model, "mistral3"),
    hf_class="Mistral3ForConditionalGeneration",
    # Resized to fit 128 pixels, then up to whole 16-pixel merged patches:
    # 140, 64, 160 and 48 patches (8-pixel), rows of [IMG] closed by [IMG_BREAK].
    sizes=((100, 70), (64, 64), (200, 120), (30, 90)),
    two_images=((100, 70), (64, 128)),
    # 140 + 64 + 48 patches in one 256-row call, 160 in another.
    packed_batch=(4, 2),
    # 200x120 -> 8x5 [IMG] tokens + 5 breaks = 45 placeholder tokens from
    # offset 8: 16-token chunks end inside the image twice.
    chunk_tokens=16,
    chunk_image=(200, 120),
    repeat_image=(96, 96, 9),
    cached_followup="What colour dominates? Answer briefly.",
    compile_settings={"token_buckets": "16,256,1024", "multimodal_buckets": "64,256"},
    compile_batched_tokens=1024,
    # The decoder layers', the final norm's and the tower's: each shared by its buckets.
    warmup_graphs=1 + 1 + 1,
    vision_buckets=[64, 256],
    patch_before_processor=True,  # PixtralProcessor without torchvision (patch 17)
)

# Qwen2.5-VL's cases and numbers hold for the tiny Qwen3-VL: its 32-pixel
# merged patches give 196, 216, 168 and 248 patches for the same sizes (one
# call each, budget 256), and the 300x200 image 9x6 = 54 image tokens from
# offset 4: 24-token chunks end inside it twice (DeepStack rows split across
# chunks too). One tower graph: every block attends within frames.
QWEN3_VL = dataclasses.replace(
    QWEN2_5_VL, name="qwen3_vl", make=make_tiny_qwen3_vl,
    hf_class="Qwen3VLForConditionalGeneration", chunk_tokens=24,
)

ARCHS = [LLAVA_NEXT, QWEN2_5_VL, MISTRAL3, QWEN3_VL]


# ---- fixtures (each needs an `arch` fixture in the module) -------------------

@pytest.fixture(scope="module")
def model_dir(arch, tmp_path_factory):
    return arch.make(tmp_path_factory.mktemp(arch.name) / arch.name)


@pytest.fixture(scope="module")
def hf(arch, model_dir):
    """(processor, model) from HF transformers, float32."""
    import transformers

    if arch.patch_before_processor:
        apply_patches()
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    model_class = getattr(transformers, arch.hf_class)
    model = model_class.from_pretrained(model_dir, dtype=torch.float32)
    return processor, model.eval()


@pytest.fixture(scope="module")
def cases(arch, hf):
    """(prompt, images): one image at each size, two images, text only."""
    processor, _ = hf
    single = [(chat_prompt(processor, 1, f"Describe picture {i}."), [noise_image(*size)])
              for i, size in enumerate(arch.sizes)]
    two = [(chat_prompt(processor, 2, "Compare them."),
            [noise_image(*size) for size in arch.two_images])]
    text = [(chat_prompt(processor, 0, "Tell me a story about a fox."), [])]
    return single + two + text


@pytest.fixture(scope="module")
def expected(hf, cases):
    """HF's greedy MAX_TOKENS continuation of each case."""
    return [hf_vision_greedy(hf, prompt, images, MAX_TOKENS) for prompt, images in cases]


@pytest.fixture(scope="module")
def llm(arch, model_dir):
    with running_llm(model_dir, **arch.engine) as llm:
        yield llm
