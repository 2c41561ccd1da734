"""Molmo's vision side, FMS style: CLIP-like ViT over image crops, attention
pooling of 2x2 patch windows, gated-MLP projector into the text embedding.

Inputs are what vLLM's Molmo processing produces for one image (or several
images' crops stacked): ``images`` [crops, patches, patch_size**2 * 3]
(normalised pixels, patches row-major), ``image_masks`` [crops, patches]
(fraction of real pixels per patch; 1 real, 0 padding, -1 "no mask") and
``image_input_idx`` [crops, pooled cells] (token position of each pooled
cell, negative: no token).

Every crop is processed on its own (the ViT attends within a crop, pooling
stays within a crop), so padding the crop axis to a fixed bucket (zero
pixels and masks) leaves the real crops' rows bit-for-bit unchanged and gives
the compiled graph a static shape. ``image_embed_order`` then picks the rows for
the ``<im_patch>`` placeholders, in prompt order.

Module and parameter names follow the hub checkpoint under
``model.vision_backbone.``. The text decoder is ``Molmo`` below: the text
side is our Qwen2 decoder (qwen2.py), configured as Molmo-7B-D's Qwen2 or
7B-O's OLMo; ``FMS_PORT`` lets FMS load the hub checkpoint into it (every weight; the embedding is the text table and the
image-token table concatenated).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from fms.distributed.strategy import DistributedStrategy, NoOpStrategy
from fms.utils.config import ModelConfig

from vllm_accel.kernels import span_attention
from vllm_accel.model.ports import FmsPort
from vllm_accel.model.qwen2 import Qwen2VisionLanguageModel
from vllm_accel.model.qwen2_layers import Qwen2Config

HF_VISION_PREFIX = "model.vision_backbone."


@dataclass
class MolmoVisionConfig(ModelConfig):
    """Defaults are Molmo-7B's vision backbone (OpenAI CLIP ViT-L/14 at 336 px
    minus its last layer), which the hub configs do not spell out."""

    crop_size: tuple[int, int] = (336, 336)
    patch_size: int = 14
    emb_dim: int = 1024
    nheads: int = 16
    nlayers: int = 23
    mlp_dim: int = 4096
    num_pos: int = 577  # patches per crop + class token
    norm_eps: float = 1e-5
    # Hidden states (after these blocks) concatenated as pooling input.
    vit_layers: tuple[int, ...] = (-2, -9)
    pooling: int = 2
    text_dim: int = 3584  # projector output: the decoder's hidden size
    projector_dim: int = 18944  # the decoder's intermediate_size // 2

    @classmethod
    def from_hf_config(cls, hf_config) -> MolmoVisionConfig:
        """Text dims from the Molmo config; vision dims from its
        ``vision_backbone_config`` (vLLM's VisionBackboneConfig field names;
        only tiny test fixtures have it) or else the full-size defaults."""
        vb = dict(getattr(hf_config, "vision_backbone_config", None) or {})
        kwargs = {"text_dim": hf_config.hidden_size,
                  "projector_dim": hf_config.intermediate_size // 2}
        names = {"image_default_input_size": "crop_size", "image_patch_size": "patch_size",
                 "image_emb_dim": "emb_dim", "image_num_heads": "nheads",
                 "image_num_layers": "nlayers", "image_mlp_dim": "mlp_dim",
                 "image_num_pos": "num_pos", "image_norm_eps": "norm_eps"}
        for hf_name, name in names.items():
            if hf_name in vb:
                kwargs[name] = tuple(vb[hf_name]) if name == "crop_size" else vb[hf_name]
        if vb.get("image_num_key_value_heads", vb.get("image_num_heads")) != vb.get(
                "image_num_heads"):
            raise ValueError("Molmo's ViT has as many key/value heads as query heads")
        if vb.get("image_mlp_activations", "quick_gelu") != "quick_gelu":
            raise ValueError("Molmo's ViT MLP uses quick_gelu")
        return cls(**kwargs)

    @property
    def layers_run(self) -> int:
        """Blocks up to the deepest selected one; later ones are never used."""
        return max(i % self.nlayers for i in self.vit_layers) + 1

    @property
    def patch_grid(self) -> tuple[int, int]:
        return self.crop_size[0] // self.patch_size, self.crop_size[1] // self.patch_size

    @property
    def pooled_grid(self) -> tuple[int, int]:
        h, w = self.patch_grid
        return -(-h // self.pooling), -(-w // self.pooling)

    @property
    def tokens_per_crop(self) -> int:
        h, w = self.pooled_grid
        return h * w


class ViTAttention(nn.Module):
    """Multi-head attention with biased q/k/v/o projections. ``in_dim`` differs
    from ``emb_dim`` for the pooling attention, whose inputs are several ViT
    layers concatenated."""

    def __init__(self, emb_dim: int, nheads: int, in_dim: int | None = None):
        super().__init__()
        in_dim = in_dim or emb_dim
        self.nheads = nheads
        self.wq = nn.Linear(in_dim, emb_dim)
        self.wk = nn.Linear(in_dim, emb_dim)
        self.wv = nn.Linear(in_dim, emb_dim)
        self.wo = nn.Linear(emb_dim, emb_dim)

    def forward(self, x_q: torch.Tensor, x_kv: torch.Tensor | None = None) -> torch.Tensor:
        """[batch, q_len, in_dim] (and [batch, kv_len, in_dim]) -> [batch, q_len, emb_dim]."""
        x_kv = x_q if x_kv is None else x_kv
        # [b, s, h*d] -> [b, s, h, d]
        q, k, v = (t.unflatten(-1, (self.nheads, -1))
                   for t in (self.wq(x_q), self.wk(x_kv), self.wv(x_kv)))
        if span_attention.supported(q) and q.shape[1] == k.shape[1]:
            out = span_attention.attend(q, k, v, q.shape[-1] ** -0.5)
        else:
            # torch's flash kernel: faster than matmul, float32 softmax, matmul
            # compiled, with half the error
            out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
            out = out.transpose(1, 2)
        return self.wo(out.flatten(2))


class ViTMLP(nn.Module):
    def __init__(self, emb_dim: int, mlp_dim: int):
        super().__init__()
        self.w1 = nn.Linear(emb_dim, mlp_dim)
        self.w2 = nn.Linear(mlp_dim, emb_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w1(x)
        return self.w2(h * torch.sigmoid(1.702 * h))  # quick_gelu, as CLIP


class ViTBlock(nn.Module):
    """Pre-norm residual block (attention, then MLP)."""

    def __init__(self, config: MolmoVisionConfig):
        super().__init__()
        self.attention = ViTAttention(config.emb_dim, config.nheads)
        self.feed_forward = ViTMLP(config.emb_dim, config.mlp_dim)
        self.attention_norm = nn.LayerNorm(config.emb_dim, eps=config.norm_eps)
        self.ffn_norm = nn.LayerNorm(config.emb_dim, eps=config.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class ViTBlocks(nn.Module):
    def __init__(self, config: MolmoVisionConfig):
        super().__init__()
        self.resblocks = nn.ModuleList(ViTBlock(config) for _ in range(config.layers_run))


class MolmoViT(nn.Module):
    """Crops of patches -> the selected layers' patch features, concatenated.
    Blocks after the deepest selected layer are not built (Molmo-7B needs 22
    of its 23: the last one's output is never used)."""

    def __init__(self, config: MolmoVisionConfig):
        super().__init__()
        self.config = config
        c = config.emb_dim
        self.class_embedding = nn.Parameter(torch.zeros(c))
        self.positional_embedding = nn.Parameter(torch.zeros(config.num_pos, c))
        self.patch_embedding = nn.Linear(config.patch_size ** 2 * 3, c, bias=False)
        self.pre_ln = nn.LayerNorm(c, eps=config.norm_eps)
        self.transformer = ViTBlocks(config)
        h, w = config.patch_grid
        if config.num_pos != h * w + 1:
            raise ValueError("positional embeddings must match the crop's patch grid "
                             "(Molmo never interpolates them at inference)")
        self.layer_ids = [i % config.nlayers for i in config.vit_layers]  # e.g. [21, 14]

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[crops, patches, pixels] -> [crops, patches, emb_dim * len(vit_layers)]."""
        x = self.patch_embedding(patches)
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype)
        x = self.pre_ln(x)
        kept = {}
        for i, block in enumerate(self.transformer.resblocks):
            x = block(x)
            kept[i] = x
        features = torch.cat([kept[i] for i in self.layer_ids], dim=-1)
        return features[:, 1:]  # drop the class token


class ImageProjector(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int):
        super().__init__()
        self.w1 = nn.Linear(in_dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(in_dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, out_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MolmoVisionBackbone(nn.Module):
    """Crops -> one text-space embedding per pooled 2x2 patch window.

    ``pad_embed[0]`` is added to the features of patches that are all
    padding (mask 0), ``pad_embed[1]`` to partly padded ones (0 < mask < 1,
    and the -1 "no mask" rows), so the model sees where the letterbox is.
    """

    def __init__(self, config: MolmoVisionConfig):
        super().__init__()
        self.config = config
        features = config.emb_dim * len(config.vit_layers)
        self.image_vit = MolmoViT(config)
        self.image_pooling_2d = ViTAttention(config.emb_dim, config.nheads, in_dim=features)
        self.image_projector = ImageProjector(config.emb_dim, config.projector_dim,
                                              config.text_dim)
        self.pad_embed = nn.Parameter(torch.zeros(2, features))

    def forward(self, images: torch.Tensor, image_masks: torch.Tensor) -> torch.Tensor:
        """images [crops, patches, pixels], image_masks [crops, patches] ->
        [crops, tokens_per_crop, text_dim] (pooled cells row-major per crop)."""
        cfg = self.config
        images = images.to(self.pad_embed.dtype)
        x = self.image_vit(images)
        # Crops that are all -1 are HF's batch padding: no features (as Molmo).
        x = x * (images != -1).any(dim=-1).any(dim=-1)[:, None, None].to(x.dtype)
        all_pad = (image_masks == 0).to(x.dtype)[..., None]
        part_pad = ((image_masks < 1) & (image_masks != 0)).to(x.dtype)[..., None]
        x = x + self.pad_embed[0] * all_pad + self.pad_embed[1] * part_pad

        # 2x2 windows (zero-padding an odd grid at the bottom/right): the
        # window's mean patch attends to its patches.
        crops, p = x.shape[0], cfg.pooling
        (gh, gw), (ph, pw) = cfg.patch_grid, cfg.pooled_grid
        x = x.reshape(crops, gh, gw, -1)
        x = F.pad(x, (0, 0, 0, pw * p - gw, 0, ph * p - gh))
        x = x.reshape(crops, ph, p, pw, p, -1).permute(0, 1, 3, 2, 4, 5)
        windows = x.reshape(crops * ph * pw, p * p, -1)
        pooled = self.image_pooling_2d(windows.mean(dim=1, keepdim=True), windows)
        return self.image_projector(pooled.reshape(crops, ph * pw, -1))


def image_embed_order(image_input_idx: torch.Tensor) -> torch.Tensor:
    """Rows of the flattened backbone output [crops * tokens_per_crop, dim] for
    the image's ``<im_patch>`` tokens, in prompt order (cells with a negative
    index have no token)."""
    flat = image_input_idx.reshape(-1)
    rows = torch.nonzero(flat >= 0).squeeze(1)
    return rows[torch.argsort(flat[rows])]


# ---------------------------------------------------------------------------
# Composite model: our Qwen2 decoder (Qwen2- or OLMo-style by config flags)
# and the vision backbone, loaded from Molmo's hub checkpoint by FMS.
# ---------------------------------------------------------------------------

ARCHITECTURE = "molmo"
HF_ARCHITECTURE = "MolmoForCausalLM"
# Rows of ``wte.new_embedding``: the image/special tokens after the text
# vocabulary (Molmo's and vLLM's ADDITIONAL_VOCAB_SIZE).
ADDITIONAL_VOCAB_SIZE = 128


@dataclass
class MolmoConfig(ModelConfig):
    text_config: Qwen2Config = field(default_factory=Qwen2Config)
    vision_config: MolmoVisionConfig = field(default_factory=MolmoVisionConfig)


class Molmo(Qwen2VisionLanguageModel):
    """``language_model`` is what the generic wrapper drives (embeddings in);
    ``vision`` turns an image's crops into its ``<im_patch>`` embeddings
    (then ``image_embed_order``), which the caller writes at those positions."""

    def __init__(self, config: MolmoConfig | None = None,
                 distributed_strategy: DistributedStrategy = NoOpStrategy, **kwargs):
        kwargs.pop("trust_remote_code", None)  # FMS passes get_model's kwargs on
        super().__init__((config or MolmoConfig()).updated(**kwargs), distributed_strategy)
        self.vision = MolmoVisionBackbone(self.config.vision_config)


def molmo_text_config_from_hf(hf_config) -> Qwen2Config:
    """Molmo-7B-D (Qwen2: qkv bias, GQA) and 7B-O (OLMo: q/k norm, norms after
    the sublayers) as one decoder with flags."""
    if getattr(hf_config, "layer_norm_type", "rms") != "rms":
        raise ValueError("Molmo: only RMSNorm decoders are supported")
    if getattr(hf_config, "clip_qkv", None) is not None:
        raise ValueError("Molmo: clip_qkv is not supported")
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"Molmo: rope type {rope.get('rope_type')!r} is not supported")
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10_000.0))
    text_vocab = hf_config.embedding_size or hf_config.vocab_size
    return Qwen2Config(
        src_vocab_size=text_vocab + ADDITIONAL_VOCAB_SIZE,
        head_vocab_size=text_vocab,
        emb_dim=hf_config.hidden_size,
        nheads=hf_config.num_attention_heads,
        kvheads=hf_config.num_key_value_heads or hf_config.num_attention_heads,
        nlayers=hf_config.num_hidden_layers,
        hidden_dim=hf_config.intermediate_size // 2,  # ff_proj is (up, gate) fused
        norm_eps=hf_config.layer_norm_eps,
        rope_theta=float(theta),
        activation_fn="silu",
        tie_heads=bool(getattr(hf_config, "weight_tying", False)),
        max_expected_seq_len=hf_config.max_position_embeddings,
        attn_bias=bool(hf_config.qkv_bias),
        qk_norm=bool(hf_config.attention_layer_norm),
        norm_after=bool(hf_config.norm_after),
    )


def molmo_config_from_hf(hf_config) -> MolmoConfig:
    return MolmoConfig(text_config=molmo_text_config_from_hf(hf_config),
                       vision_config=MolmoVisionConfig.from_hf_config(hf_config))


_HF_TEXT = "model.transformer."
# Per-layer hub names -> ours (att_proj and ff_proj are split in _split_fused).
_LAYER_RENAMES = {
    "attn_out.": "attn.dense.",
    "q_norm.": "attn.in_proj.q_norm.",
    "k_norm.": "attn.in_proj.k_norm.",
    "ff_out.": "ff_sub_layer.w2.",
    "attn_norm.": "ln.",
    "ff_norm.": "ff_ln.",
}


def _split_fused(prefix: str, name: str, tensor: torch.Tensor, text: Qwen2Config) -> dict:
    """att_proj rows are (q, k, v); ff_proj rows are (up, gate): vLLM's
    MulAndSilu computes up * silu(gate) from the first and second halves."""
    if name.startswith("att_proj."):
        kind = name[len("att_proj."):]
        kv = (text.kvheads or text.nheads) * text.head_dim
        q, k, v = tensor.split([text.nheads * text.head_dim, kv, kv])
        return {f"{prefix}attn.in_proj.query.{kind}": q, f"{prefix}attn.in_proj.key.{kind}": k,
                f"{prefix}attn.in_proj.value.{kind}": v}
    if name.startswith("ff_proj."):
        kind = name[len("ff_proj."):]
        up, gate = tensor.chunk(2)
        return {f"{prefix}ff_sub_layer.w1.{kind}": up, f"{prefix}ff_sub_layer.wg.{kind}": gate}
    for old, new in _LAYER_RENAMES.items():
        if name.startswith(old):
            return {prefix + new + name[len(old):]: tensor}
    raise KeyError(f"unknown Molmo decoder weight {name!r}")


def _hf_to_fms_names(sd: Mapping[str, Any], model_config: MolmoConfig | None = None,
                     **_) -> dict:
    config = model_config or MolmoConfig()
    text = config.text_config
    out: dict[str, torch.Tensor] = {}
    embedding = {}
    for name, tensor in sd.items():
        if name.startswith(HF_VISION_PREFIX):
            rest = name[len(HF_VISION_PREFIX):]
            block = re.match(r"image_vit\.transformer\.resblocks\.(\d+)\.", rest)
            if block and int(block.group(1)) >= config.vision_config.layers_run:
                continue  # after the deepest feature layer: never built, never used
            out["vision." + rest] = tensor
        elif name in (_HF_TEXT + "wte.embedding", _HF_TEXT + "wte.new_embedding"):
            embedding[name.rsplit(".", 1)[1]] = tensor
        elif name == _HF_TEXT + "ln_f.weight":
            out["language_model.base_model.dec_norm.weight"] = tensor
        elif name == _HF_TEXT + "ff_out.weight":
            out["language_model.head.weight"] = tensor
        elif (layer := re.match(r"model\.transformer\.blocks\.(\d+)\.(.*)", name)):
            prefix = f"language_model.base_model.layers.{layer.group(1)}."
            out.update(_split_fused(prefix, layer.group(2), tensor, text))
        else:
            out[name] = tensor  # unknown: left for FMS to report
    if embedding:
        if set(embedding) != {"embedding", "new_embedding"}:
            raise ValueError("Molmo's wte.embedding and wte.new_embedding load together")
        # Text vocabulary first, then the image/special tokens (as vLLM merges them).
        out["language_model.base_model.embedding.weight"] = torch.cat(
            [embedding["embedding"], embedding["new_embedding"]])
    return out


FMS_PORT = FmsPort(
    fms_architecture=ARCHITECTURE, hf_architecture=HF_ARCHITECTURE, model_class=Molmo,
    config_from_hf=molmo_config_from_hf, hf_to_fms_names=_hf_to_fms_names,
    fused_prefix="language_model.", text_config_attr="text_config",
)
