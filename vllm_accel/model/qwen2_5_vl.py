"""Qwen2.5-VL in IBM foundation-model-stack (FMS) style: composite model,
M-RoPE prompt positions and FMS registration.

    Qwen2_5_VL
      language_model  Qwen2 (vllm_accel/model/qwen2.py) with M-RoPE
      visual          Qwen2_5_VisionTransformer (vllm_accel/model/qwen2_5_vl_vision.py:
                      window attention, static shapes for torch.compile)

``FMS_PORT`` tells FMS how to load the hub checkpoint (registered by the
loader, ``model/ports.py``, not at import).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch

from fms.distributed.strategy import DistributedStrategy, NoOpStrategy
from fms.utils.config import ModelConfig

from vllm_accel.model.ports import FmsPort, renamed
from vllm_accel.model.qwen2 import (
    Qwen2VisionLanguageModel,
    qwen2_config_from_hf,
    rename_hf_text_key,
)
from vllm_accel.model.qwen2_5_vl_vision import Qwen2_5_VisionConfig, Qwen2_5_VisionTransformer
from vllm_accel.model.qwen2_layers import Qwen2Config

ARCHITECTURE = "qwen2_5_vl"
HF_ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"


@dataclass
class Qwen2_5_VLConfig(ModelConfig):
    # Defaults: Qwen2.5-VL-3B's shapes.
    text_config: Qwen2Config = field(default_factory=lambda: Qwen2Config(
        emb_dim=2048, nheads=16, kvheads=2, nlayers=36, hidden_dim=11008,
        mrope_section=[16, 24, 24], tie_heads=True))
    vision_config: Qwen2_5_VisionConfig = field(default_factory=Qwen2_5_VisionConfig)
    image_token_id: int = 151_655
    video_token_id: int = 151_656
    vision_start_token_id: int = 151_652
    vision_end_token_id: int = 151_653

    @property
    def spatial_merge_size(self) -> int:
        return self.vision_config.spatial_merge_size


# ---------------------------------------------------------------------------
# Composite model
# ---------------------------------------------------------------------------


class Qwen2_5_VL(Qwen2VisionLanguageModel):
    """The text model our generic wrapper drives is ``language_model``; the
    caller runs ``visual`` on each image and writes its rows into the prompt
    embeddings at the image-token positions. (Qwen3-VL's port is this class
    with its own config and tower.)"""

    config_class: type = Qwen2_5_VLConfig
    vision_class: type = Qwen2_5_VisionTransformer

    def __init__(self, config: Optional[Qwen2_5_VLConfig] = None, vision_only: bool = False,
                 distributed_strategy: DistributedStrategy = NoOpStrategy, **kwargs):
        if vision_only:
            raise NotImplementedError(f"{type(self).__name__} has no vision-only mode")
        super().__init__((config or self.config_class()).updated(**kwargs), distributed_strategy)
        self.visual = self.vision_class(self.config.vision_config)


def mrope_positions(
    token_ids: Sequence[int], image_grid_thw: Sequence[Sequence[int]], *,
    image_token_id: int, vision_start_token_id: int, spatial_merge_size: int,
) -> tuple[torch.Tensor, int]:
    """M-RoPE positions of a prompt, as HF's ``get_rope_index`` (images only).

    Text tokens advance all three axes together. The t*(h/m)*(w/m) tokens of
    an image (one run of image_token_id right after vision_start_token_id; m =
    spatial_merge_size) start from the next text position p: their positions
    are (p + frame, p + merged row, p + merged column). Text after the image
    resumes at p + max(h/m, w/m).

    Returns (positions [3, L] int64, delta): the token at index i >= L (decode)
    has position i + delta on all three axes.
    """
    tokens = list(token_ids)
    grids = iter(image_grid_thw)
    columns: list[torch.Tensor] = []
    pos = i = 0
    while i < len(tokens):
        if tokens[i] != image_token_id:
            columns.append(torch.full((3, 1), pos, dtype=torch.long))
            pos += 1
            i += 1
            continue
        if i == 0 or tokens[i - 1] != vision_start_token_id:
            raise ValueError(f"image token at {i} does not follow the vision start token")
        try:
            t, h, w = (int(v) for v in next(grids))
        except StopIteration:
            raise ValueError("more images in the prompt than image_grid_thw entries") from None
        hm, wm = h // spatial_merge_size, w // spatial_merge_size
        n = t * hm * wm
        if tokens[i:i + n] != [image_token_id] * n:
            raise ValueError(f"image at {i} needs {n} consecutive image tokens")
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(hm), torch.arange(wm),
                                          indexing="ij"))
        columns.append(grid.reshape(3, -1) + pos)
        pos += max(hm, wm)
        i += n
    if next(grids, None) is not None:
        raise ValueError("fewer images in the prompt than image_grid_thw entries")
    positions = torch.cat(columns, dim=1) if columns else torch.zeros(3, 0, dtype=torch.long)
    delta = (int(positions.max()) + 1 - len(tokens)) if tokens else 0
    return positions, delta


# ---------------------------------------------------------------------------
# HF config and checkpoint -> FMS
# ---------------------------------------------------------------------------


def qwen2_5_vl_config_from_hf(hf_config) -> Qwen2_5_VLConfig:
    text = qwen2_config_from_hf(hf_config.text_config)
    text.tie_heads = bool(hf_config.tie_word_embeddings)
    if text.mrope_section is None:
        raise ValueError("Qwen2.5-VL text config has no mrope_section")
    v = hf_config.vision_config
    vision_rope = getattr(v, "rope_parameters", None) or {}
    vision = Qwen2_5_VisionConfig(
        depth=v.depth, emb_dim=v.hidden_size, nheads=v.num_heads, hidden_dim=v.intermediate_size,
        in_channels=v.in_channels, patch_size=v.patch_size,
        temporal_patch_size=v.temporal_patch_size, spatial_merge_size=v.spatial_merge_size,
        window_size=v.window_size, fullatt_block_indexes=list(v.fullatt_block_indexes),
        out_dim=v.out_hidden_size, rope_theta=float(vision_rope.get("rope_theta", 10_000.0)),
        activation_fn=v.hidden_act,
    )
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **vision_token_ids(hf_config))


def vision_token_ids(hf_config) -> dict[str, int]:
    """The image, video and vision start/end token ids of a Qwen-VL HF config."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return {name: getattr(hf_config, name) for name in names}


_VISION_RENAMES = (
    (r"^visual\.blocks\.", "visual.layers."),
    (r"\.norm1\.", ".ln."),
    (r"\.norm2\.", ".ff_ln."),
    (r"\.attn\.proj\.", ".attn.dense."),
    (r"\.mlp\.gate_proj\.", ".mlp.wg."),
    (r"\.mlp\.up_proj\.", ".mlp.w1."),
    (r"\.mlp\.down_proj\.", ".mlp.w2."),
    (r"^visual\.patch_embed\.proj\.", "visual.patch_embed."),
    (r"^visual\.merger\.mlp\.0\.", "visual.merger.fc1."),
    (r"^visual\.merger\.mlp\.2\.", "visual.merger.fc2."),
)


def qwen_vl_names(vision_renames: tuple[tuple[str, str], ...]):
    """The checkpoint-key mapping of a Qwen-VL port whose tower's keys (after
    ``visual.``) ``vision_renames`` rename: hub layout (model.layers.*,
    model.embed_tokens, model.norm, visual.*, lm_head) and transformers-5
    layout (model.language_model.*, model.visual.*) -> our names."""

    def hf_to_fms_names(sd: Mapping[str, Any], **_) -> dict:
        out = {}
        for name, tensor in sd.items():
            name = re.sub(r"^model\.language_model\.", "model.", name)
            name = re.sub(r"^model\.visual\.", "visual.", name)
            if name.startswith("visual."):
                name = renamed(name, vision_renames)
                if name == "visual.patch_embed.weight":
                    tensor = tensor.flatten(1)  # Conv3d [D, C, T, P, P] -> linear [D, C*T*P*P]
            else:
                name = rename_hf_text_key(name, "model.", "language_model.") or name
            out[name] = tensor
        return out

    return hf_to_fms_names


FMS_PORT = FmsPort(
    fms_architecture=ARCHITECTURE, hf_architecture=HF_ARCHITECTURE, model_class=Qwen2_5_VL,
    config_from_hf=qwen2_5_vl_config_from_hf, hf_to_fms_names=qwen_vl_names(_VISION_RENAMES),
    fused_prefix="language_model.", text_config_attr="text_config",
)
