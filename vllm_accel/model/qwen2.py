"""A Qwen2 decoder in IBM foundation-model-stack (FMS) style.

FMS 1.13 has no Qwen2. Its LLaMA is close but cannot express Qwen2's
attention (q/k/v projections *with* bias, an output projection *without*).
This module assembles the decoder, with the same layout as FMS's
LLaMA/Granite/Qwen3, from the config and block of
``vllm_accel/model/qwen2_layers.py`` (attention, MLP, rotary in HF's
rotate-half layout, 1-D or M-RoPE, and their tensor-parallel forms), and maps
HF configs and checkpoints onto it:

    Qwen2
      base_model: Qwen2Headless
        embedding   nn.Embedding
        layers      nn.ModuleList[Qwen2Block]   (identical blocks)
        dec_norm    RMSNorm
      head          LinearClassificationHead

Config flags cover the OLMo-style decoder of Molmo-7B-O with the same block
(see qwen2_layers.py), and a head narrower than the embedding
(``head_vocab_size``: Molmo's extra image-token rows the head never emits).

The generic FMS wrapper (vllm_accel/model/fms_causal_lm.py) drives it as it
drives FMS's own decoders: ``base_model(x, position_ids=...,
past_key_value_states=..., use_cache=True, attn_name=...)`` with ``x`` token
ids [1, T] or embeddings [1, T, emb_dim]. Embeddings may be wider, [1, T,
(1 + k) * emb_dim] (``split_layer_additions``): the first emb_dim columns are
the input, the j-th further emb_dim columns are added to the hidden states
after layer j (Qwen3-VL's DeepStack image features; zero where a token takes
none, so the sum is the plain one there).

Tensor parallelism goes through FMS's own strategy, as in FMS's LLaMA: each
block passes through ``distributed_strategy.distribute_layer``, which swaps
attention and MLP for their TP forms (``to_tp`` in qwen2_layers.py).
Embedding, final norm and LM head stay whole on every rank, as FMS's LLaMA
keeps them.

It is the decoder of our Qwen2.5-VL and Molmo ports, which register with FMS
(``FMS_PORT`` in their modules); plain Qwen2 checkpoints are not served.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from fms.distributed.strategy import DistributedStrategy, NoOpStrategy
from fms.modules.head import LinearClassificationHead

from vllm_accel.model.qwen2_layers import Qwen2Block, Qwen2Config, Qwen2Rotary, rms_norm


class Qwen2Headless(nn.Module):
    def __init__(self, config: Qwen2Config,
                 distributed_strategy: DistributedStrategy = NoOpStrategy):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.src_vocab_size, config.emb_dim)
        self.rotary = Qwen2Rotary(config.head_dim, config.rope_theta, config.mrope_section,
                                  config.mrope_interleaved)
        self.layers = nn.ModuleList(
            distributed_strategy.distribute_layer(Qwen2Block(config, self.rotary), i)
            for i in range(config.nlayers))
        self.dec_norm = rms_norm(config.emb_dim, config.norm_eps)

    def forward(self, x, position_ids=None, past_key_value_states=None, use_cache=False,
                **attn_kwargs):
        """x: token ids [B, T] or embeddings [B, T, emb_dim]. Returns
        (hidden [B, T, emb_dim], per-layer caches (when use_cache))."""
        if not x.is_floating_point():
            x = self.embedding(x)
        x, additions = split_layer_additions(x, self.config.emb_dim)
        if not past_key_value_states:
            past_key_value_states = [None] * len(self.layers)
        caches = []
        for i, (layer, past) in enumerate(zip(self.layers, past_key_value_states)):
            out = layer(x, position_ids=position_ids, past_key_value_state=past,
                        use_cache=use_cache, **attn_kwargs)
            if use_cache:
                x, cache = out
                caches.append(cache)
            else:
                x = out
            if i < len(additions):
                x = x + additions[i]
        return self.dec_norm(x), caches


def split_layer_additions(x, emb_dim: int):
    """Embeddings [B, T, (1 + k) * emb_dim] -> (the input [B, T, emb_dim],
    k additions [B, T, emb_dim]: the j-th is added after layer j)."""
    if x.shape[-1] % emb_dim:
        raise ValueError(f"embeddings of width {x.shape[-1]}: not a multiple of {emb_dim}")
    parts = x.split(emb_dim, dim=-1)
    return parts[0], parts[1:]


class Qwen2(nn.Module):
    def __init__(self, config: Optional[Qwen2Config] = None,
                 distributed_strategy: DistributedStrategy = NoOpStrategy, **kwargs):
        super().__init__()
        self.config = (config or Qwen2Config()).updated(**kwargs)
        self.base_model = Qwen2Headless(self.config, distributed_strategy)
        self.head = LinearClassificationHead(
            self.config.emb_dim, self.config.head_vocab_size or self.config.src_vocab_size,
            bias=False)

    def get_config(self) -> Qwen2Config:
        return self.config

    def post_init(self):
        """Called by fms.models.get_model after loading: tie the lm_head to
        the embedding when the config says so (tied checkpoints carry no
        lm_head tensor)."""
        if self.config.tie_heads:
            if self.head.weight.shape != self.base_model.embedding.weight.shape:
                raise ValueError("tied LM head and embedding must have the same rows")
            self.head.weight = self.base_model.embedding.weight

    def forward(self, x, position_ids=None, past_key_value_states=None, use_cache=False,
                **attn_kwargs):
        hidden, cache = self.base_model(x, position_ids, past_key_value_states, use_cache,
                                        **attn_kwargs)
        logits = self.head(hidden)
        return (logits, cache) if use_cache else logits


class Qwen2VisionLanguageModel(nn.Module):
    """Base of our composite FMS models whose text side is this decoder
    (``language_model``: what the generic wrapper drives, fed embeddings)."""

    def __init__(self, config, distributed_strategy: DistributedStrategy = NoOpStrategy):
        super().__init__()
        self.config = config
        # Only the decoder is sharded; the vision side stays whole on every
        # rank (the runner encodes each image on one rank and shares it).
        self.language_model = Qwen2(config.text_config, distributed_strategy)

    def get_config(self):
        return self.config

    def post_init(self):
        self.language_model.post_init()


# ---------------------------------------------------------------------------
# HF config and checkpoint -> FMS
# ---------------------------------------------------------------------------


def qwen2_config_from_hf(text_config) -> Qwen2Config:
    """A Qwen2Config from an HF Qwen2 / Qwen2-VL / Qwen2.5-VL text config."""
    # transformers 5 folds rope_theta/rope_scaling into rope_parameters.
    rope = (getattr(text_config, "rope_parameters", None)
            or getattr(text_config, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ValueError(f"Qwen2: rope type {rope_type!r} is not supported")
    head_dim = getattr(text_config, "head_dim", None)
    theta = rope.get("rope_theta", getattr(text_config, "rope_theta", 10_000.0))
    if getattr(text_config, "use_sliding_window", False):
        raise ValueError("Qwen2: sliding-window attention is not supported")
    return Qwen2Config(
        src_vocab_size=text_config.vocab_size,
        emb_dim=text_config.hidden_size,
        nheads=text_config.num_attention_heads,
        kvheads=text_config.num_key_value_heads or text_config.num_attention_heads,
        nlayers=text_config.num_hidden_layers,
        hidden_dim=text_config.intermediate_size,
        norm_eps=text_config.rms_norm_eps,
        rope_theta=float(theta),
        mrope_section=list(rope["mrope_section"]) if rope.get("mrope_section") else None,
        mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
        head_size=head_dim if head_dim and head_dim * text_config.num_attention_heads
        != text_config.hidden_size else None,
        activation_fn=text_config.hidden_act,
        tie_heads=bool(getattr(text_config, "tie_word_embeddings", False)),
        max_expected_seq_len=text_config.max_position_embeddings,
    )


# HF decoder-layer module names -> ours (inside "layers.N.").
_LAYER_RENAMES = {
    "self_attn.q_proj.": "attn.in_proj.query.", "self_attn.k_proj.": "attn.in_proj.key.",
    "self_attn.v_proj.": "attn.in_proj.value.", "self_attn.o_proj.": "attn.dense.",
    "mlp.gate_proj.": "ff_sub_layer.wg.", "mlp.up_proj.": "ff_sub_layer.w1.",
    "mlp.down_proj.": "ff_sub_layer.w2.",
    "input_layernorm.": "ln.", "post_attention_layernorm.": "ff_ln.",
    "self_attn.q_norm.": "attn.in_proj.q_norm.", "self_attn.k_norm.": "attn.in_proj.k_norm.",
}


def rename_hf_text_key(name: str, hf_prefix: str = "model.", fms_prefix: str = "") -> str | None:
    """Map one HF Qwen2 key (``{hf_prefix}layers.N...``, ``{hf_prefix}embed_tokens``,
    ``{hf_prefix}norm``, ``lm_head``) to our name under ``fms_prefix``, or None
    if it is not a text-model key."""
    if name == "lm_head.weight":
        return fms_prefix + "head.weight"
    if not name.startswith(hf_prefix):
        return None
    rest = name[len(hf_prefix):]
    if rest.startswith("embed_tokens."):
        return fms_prefix + "base_model.embedding." + rest[len("embed_tokens."):]
    if rest.startswith("norm."):
        return fms_prefix + "base_model.dec_norm." + rest[len("norm."):]
    if rest.startswith("layers."):
        for hf_name, name in _LAYER_RENAMES.items():
            rest = rest.replace("." + hf_name, "." + name)
        return fms_prefix + "base_model." + rest
    return None
