"""Multimodal inputs: one image's tensors from vLLM's scheduler output, and
real warmup images through the model's own HF processor."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def item_tensors(feature_data: Any) -> dict[str, torch.Tensor]:
    """One image's tensors from ``MultiModalFeatureSpec.data`` (a
    ``MultiModalKwargsItem``: key -> ``MultiModalFieldElem``).

    vLLM's GPU runner batches items with ``group_and_batch_mm_kwargs``, which
    reduces each key's ``elem.data`` across items with its field (stack for
    batched fields, concat for flat ones). For a single item that input,
    ``elem.data``, is the per-item tensor itself: e.g. for LlavaNext
    ``pixel_values`` [tiles, 3, H, W] and ``image_sizes`` [2].
    """
    if feature_data is None:
        raise ValueError("multimodal item has no data (already encoded and cached, "
                         "or covered by the prefix cache): nothing to encode")
    tensors = {}
    for key, elem in feature_data.items():
        if isinstance(elem.data, (bool, int, float)):
            # A shared scalar field (e.g. Molmo's img_patch_id): a 0-d tensor.
            tensors[key] = torch.tensor(elem.data)
            continue
        if not isinstance(elem.data, torch.Tensor):
            raise TypeError(f"multimodal field {key!r} holds {type(elem.data).__name__}, "
                            "not a tensor")
        tensors[key] = elem.data
    return tensors


def warmup_image(width: int, height: int, seed: int = 0):
    """A deterministic RGB noise image (PIL) of width x height pixels."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def processor_items(processor_dir: str, image_sizes: list[tuple[int, int]],
                    trust_remote_code: bool = False) -> list[dict[str, torch.Tensor]]:
    """Noise images of the given (width, height) sizes through the model's own
    HF image processor, one item per image as ``item_tensors`` gives them, for
    processors whose outputs are batched per image (vLLM's
    ``MultiModalFieldConfig.batched``)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(processor_dir, local_files_only=True,
                                              trust_remote_code=trust_remote_code)
    items = []
    for seed, (width, height) in enumerate(image_sizes):
        out = processor.image_processor(images=[warmup_image(width, height, seed)],
                                        return_tensors="pt")
        items.append({k: v[0] for k, v in out.items() if isinstance(v, torch.Tensor)})
    return items
