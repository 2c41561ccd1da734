"""What only the tests of our FMS ports need: driving a port's parts outside
the engine (the runner pads, merges and loads through the shared machinery)."""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F

from vllm_accel.model.molmo import HF_VISION_PREFIX, MolmoVisionBackbone, image_embed_order
from vllm_accel.model.ports import FmsPort, register_port
from vllm_accel.model.qwen2 import Qwen2, qwen2_config_from_hf, rename_hf_text_key

# ---- Molmo's vision backbone alone -------------------------------------------


def pad_crops(images: torch.Tensor, image_masks: torch.Tensor, image_input_idx: torch.Tensor,
              num_crops: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad the crop axis to ``num_crops`` (a compile bucket): zero pixels,
    zero masks, and no tokens (-1) for the padding crops."""
    extra = num_crops - images.shape[0]
    if extra < 0:
        raise ValueError(f"{images.shape[0]} crops do not fit a bucket of {num_crops}")
    return (F.pad(images, (0, 0, 0, 0, 0, extra)), F.pad(image_masks, (0, 0, 0, extra)),
            F.pad(image_input_idx, (0, 0, 0, extra), value=-1))


def image_embeddings(backbone: MolmoVisionBackbone, images: torch.Tensor,
                     image_masks: torch.Tensor, image_input_idx: torch.Tensor) -> torch.Tensor:
    """One image's placeholder embeddings [number of its <im_patch> tokens,
    text_dim], eagerly. One image at a time: image_input_idx is only ordered
    within an image (the hub's processor gives every image offset 0)."""
    per_crop = backbone(images, image_masks)
    return per_crop.reshape(-1, per_crop.shape[-1])[image_embed_order(image_input_idx)]


def load_hf_vision_weights(backbone: MolmoVisionBackbone,
                           state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load ``model.vision_backbone.*`` hub weights; every parameter must be
    present and every vision key used (raises otherwise)."""
    own = {k[len(HF_VISION_PREFIX):]: v for k, v in state_dict.items()
           if k.startswith(HF_VISION_PREFIX)}
    # Blocks past the deepest used layer are in the checkpoint but not built.
    built = backbone.config.layers_run
    prefix = "image_vit.transformer.resblocks."
    used = {k: v for k, v in own.items()
            if not k.startswith(prefix) or int(k[len(prefix):].split(".")[0]) < built}
    backbone.load_state_dict(used, strict=True)


# ---- Qwen2.5-VL's merge, as HF does it ----------------------------------------


def merge_image_features(model, input_ids: torch.Tensor,
                         image_features: torch.Tensor | None) -> torch.Tensor:
    """input_ids [B, T] -> embeddings [B, T, emb_dim], image-token rows
    replaced in order by image_features [num_image_tokens, emb_dim]."""
    embeds = model.language_model.base_model.embedding(input_ids)
    if image_features is not None:
        is_image = input_ids == model.config.image_token_id
        if int(is_image.sum()) != image_features.shape[0]:
            raise ValueError(f"{int(is_image.sum())} image tokens but "
                             f"{image_features.shape[0]} image feature rows")
        embeds = embeds.masked_scatter(is_image[..., None], image_features.to(embeds.dtype))
    return embeds


# ---- our Qwen2 decoder as a plain Qwen2ForCausalLM ----------------------------


def _qwen2_names(state_dict: Mapping[str, Any], **_) -> dict:
    return {rename_hf_text_key(name) or name: tensor for name, tensor in state_dict.items()}


QWEN2_PORT = FmsPort(
    fms_architecture="qwen2", hf_architecture="Qwen2ForCausalLM", model_class=Qwen2,
    config_from_hf=qwen2_config_from_hf, hf_to_fms_names=_qwen2_names, fused_prefix="",
)


def register_qwen2() -> None:
    """Let FMS load Qwen2ForCausalLM checkpoints into our decoder (the
    platform does not serve Qwen2; the decoder is tested alone this way)."""
    register_port(QWEN2_PORT)
