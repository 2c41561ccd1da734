"""What only the tests of our FMS ports need: driving a port's parts outside
the engine (the runner pads, merges and loads through the shared machinery)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from helpers import noise_image as image  # noqa: F401 (the port tests' images)
from vllm_accel.compat import register_fms_config_mapping
from vllm_accel.model.fms_causal_lm import _load_with_nan_fill, check_all_weights_loaded
from vllm_accel.model.molmo import HF_VISION_PREFIX, MolmoVisionBackbone, image_embed_order
from vllm_accel.model.ports import FmsPort, register_port
from vllm_accel.model.qwen2 import Qwen2, qwen2_config_from_hf, rename_hf_text_key
from vllm_accel.model.qwen2_5_vl import mrope_positions

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


# ---- Qwen2.5-VL's and Qwen3-VL's merge, as HF does it --------------------------


def merge_image_features(model, input_ids: torch.Tensor,
                         image_features: torch.Tensor | None) -> torch.Tensor:
    """input_ids [B, T] -> embeddings [B, T, emb_dim], image-token rows
    replaced in order by image_features [num_image_tokens, emb_dim]. Wider
    features (Qwen3-VL's, with DeepStack's after the embedding): the
    embeddings are widened with zeros to match."""
    embeds = model.language_model.base_model.embedding(input_ids)
    if image_features is not None:
        extra = image_features.shape[-1] - embeds.shape[-1]
        embeds = F.pad(embeds, (0, extra))
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


@contextmanager
def qwen2_registered():
    """Let FMS load Qwen2ForCausalLM checkpoints into our decoder while the
    block runs (the platform does not serve Qwen2; the decoder is tested alone
    this way). The HF name is unmapped afterwards: FMS's registry is shared by
    every test in the process, and one compares it with what we serve."""
    from fms.models.hf.config_utils import _FMS_MODEL_CONFIG_REGISTRY as registry

    register_port(QWEN2_PORT)  # FMS's model and adapters: once per process
    name = QWEN2_PORT.hf_architecture
    register_fms_config_mapping(name, QWEN2_PORT.fms_architecture, QWEN2_PORT.config_from_hf)
    try:
        yield
    finally:
        registry.model_arch_mappings.pop(name, None)
        registry.model_param_builders.pop(name, None)


# ---- Qwen2.5-VL's and Qwen3-VL's ports driven like HF's generate ----------------

STEPS = 6
QUESTION = "What is in the picture?"


def load_port_model(port: FmsPort, path):
    """A checkpoint loaded through our port, float32, every weight loaded."""
    register_port(port)
    model = _load_with_nan_fill(str(path), torch.float32, "cpu")  # unloaded weights -> NaN
    check_all_weights_loaded(model, str(path))
    return model.eval()


def processed(processor, images, text=QUESTION):
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}],
                                           add_generation_prompt=True)
    return processor(text=prompt, images=images or None, return_tensors="pt")


def prompt_positions(model, input_ids, grid_thw):
    c = model.config
    return mrope_positions(
        input_ids, grid_thw, image_token_id=c.image_token_id,
        vision_start_token_id=c.vision_start_token_id, spatial_merge_size=c.spatial_merge_size,
    )


def fms_logits(model, input_ids: list[int], features, positions):
    """Full forward of the text model: ids -> embeddings (image rows
    replaced) -> logits [T, vocab]."""
    ids = torch.tensor([input_ids])
    embeds = merge_image_features(model, ids, features)
    hidden, _ = model.language_model.base_model(
        embeds, position_ids=positions.unsqueeze(1), use_cache=True)
    return model.language_model.head(hidden)[0]


@torch.no_grad()
def fms_generate(model, inputs, steps=STEPS):
    """Greedy, recomputing the whole sequence each step. Returns
    (prompt logits, generated ids)."""
    grid = inputs.image_grid_thw.tolist() if "image_grid_thw" in inputs else []
    features = model.visual(inputs.pixel_values, grid) if grid else None
    ids = inputs.input_ids[0].tolist()
    positions, delta = prompt_positions(model, ids, grid)
    prompt_logits = None
    for _ in range(steps):
        logits = fms_logits(model, ids, features, positions)
        prompt_logits = logits if prompt_logits is None else prompt_logits
        ids.append(int(logits[-1].argmax()))
        decode = torch.full((3, 1), len(ids) - 1 + delta)  # the new token's position
        positions = torch.cat([positions, decode], dim=1)
    return prompt_logits, ids[inputs.input_ids.shape[1]:]


@torch.no_grad()
def hf_generate(model, inputs, steps=STEPS):
    logits = model(**inputs).logits[0]
    out = model.generate(**inputs, max_new_tokens=steps, do_sample=False)
    return logits, out[0, inputs.input_ids.shape[1]:].tolist()


def assert_greedy_matches_hf(hf, model, images, logits_atol: float) -> None:
    """Our port's prompt logits (within ``logits_atol``) and STEPS greedy
    tokens equal HF's (hf = (processor, model)) for QUESTION on ``images``."""
    processor, hf_model = hf
    inputs = processed(processor, images)
    hf_logits, hf_tokens = hf_generate(hf_model, inputs)
    logits, tokens = fms_generate(model, inputs)
    torch.testing.assert_close(logits, hf_logits, atol=logits_atol, rtol=0)
    assert tokens == hf_tokens
    assert len(set(hf_tokens)) > 1, "fixture should give varied greedy output"
