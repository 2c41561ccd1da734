"""The layers of our FMS-style Qwen2 decoder (vllm_accel/model/qwen2.py): its
config, and the decoder block built from FMS's own parts (MultiHeadAttention,
GatedLinearUnit, LayerNormParameterized as RMSNorm).

    Qwen2Block
      ln, ff_ln      RMSNorm
      attn           Qwen2Attention   q/k/v projection (with bias), rotary, output (no bias)
      ff_sub_layer   Qwen2MLP         gated SiLU MLP of exact inner width
                     (or experts: RoutedFeedForward, MolmoE's OLMoE decoder)

FMS's LLaMA is close but cannot express Qwen2's attention: q/k/v projections
*with* bias and an output projection *without*. Config flags cover the
OLMo-style decoder of Molmo-7B-O with the same block (``attn_bias`` off,
``qk_norm``: RMSNorm over the whole q and k widths before rotary,
``norm_after``: x + norm(attn(x)) instead of x + attn(norm(x))), and Qwen3's
(Qwen3-VL's text model: ``attn_bias`` off, ``qk_norm_per_head``: RMSNorm over
each head's width, ``head_size`` apart from emb_dim / nheads).

Rotary embedding follows HF's "rotate half" convention, so checkpoint q/k
weights load unpermuted (FMS's RotaryEmbedding pairs adjacent dims and needs a
weight permutation; it also cannot take multi-axis positions). With
``mrope_section`` set (Qwen2-VL / Qwen2.5-VL), positions are [3, B, T]
(temporal, height, width) and each rotary frequency takes its angle from one
axis: the first mrope_section[0] frequencies from t, the next
mrope_section[1] from h, the rest from w; interleaved (``mrope_interleaved``,
Qwen3-VL), frequency j takes h where j % 3 == 1 and j < 3 * mrope_section[1],
w where j % 3 == 2 and j < 3 * mrope_section[2], else t. Without it,
positions are [B, T].

Tensor parallelism: FMS's TensorParallelStrategy calls each module's
``to_tp``. ``Qwen2Attention.to_tp`` gives FMS's TP attention (heads split
across ranks, output all-reduced; KV heads split, or replicated when fewer
than ranks) with Qwen2's q/k/v bias and the whole-width q/k norm (the norm's
mean of squares all-reduced over the ranks' slices, ``ShardedRMSNorm``);
``Qwen2MLP.to_tp`` FMS's TP MLP with each rank's exact share of the rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from fms.distributed.tensorparallel import reduce_from_tensor_model_parallel_region
from fms.modules.attention import (
    FusedQKV,
    MultiHeadAttention,
    TPMultiHeadAttention,
    UnfusedQKV,
)
from fms.modules.feedforward import GatedLinearUnit, TPGatedLinearUnit
from fms.modules.layernorm import LayerNormParameterized
from fms.modules.positions import PositionEncoder
from fms.utils.activation import str_to_activation
from fms.utils.config import ModelConfig

from vllm_accel.model.experts import RoutedFeedForward


@dataclass
class Qwen2Config(ModelConfig):
    src_vocab_size: int = 151_936
    emb_dim: int = 896
    nheads: int = 14
    kvheads: int = 2
    nlayers: int = 24
    hidden_dim: int = 4864  # MLP inner size (HF intermediate_size), exact
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    # M-RoPE: rotary frequencies per position axis (t, h, w), summing to
    # head_dim // 2. None: plain 1-D RoPE.
    mrope_section: Optional[list[int]] = None
    # Qwen3-VL's layout of those frequencies: t, h, w interleaved (see above).
    mrope_interleaved: bool = False
    activation_fn: str = "silu"
    tie_heads: bool = False
    max_expected_seq_len: int = 32_768
    fused_weights: bool = True  # one qkv matmul and one gate/up matmul
    pad_id: int = -1
    attn_bias: bool = True  # bias on the q/k/v projections (never on the output)
    # RMSNorm over all query heads together (and all key heads), after the
    # projection and before rotary, as OLMo (Molmo-7B-O).
    qk_norm: bool = False
    # RMSNorm over each query and key head's width (one weight of head_dim
    # shared by the heads), after the projection and before rotary, as Qwen3.
    qk_norm_per_head: bool = False
    # A head's width where it is not emb_dim // nheads (Qwen3's head_dim).
    head_size: Optional[int] = None
    # Norms on the sublayer outputs: x + ln(attn(x)), x + ff_ln(mlp(x)) (OLMo).
    norm_after: bool = False
    # Rows of the LM head when fewer than the embedding's (None: src_vocab_size).
    head_vocab_size: Optional[int] = None
    # Experts in place of the MLP (0: the dense MLP), hidden_dim wide each:
    # every token through its top_k_experts, their softmax weights
    # renormalized over the k or kept (experts.RoutedFeedForward).
    num_experts: int = 0
    top_k_experts: int = 0
    renormalize_experts: bool = True

    @property
    def head_dim(self) -> int:
        return self.head_size or self.emb_dim // self.nheads


def rms_norm(dim: int, eps: float) -> LayerNormParameterized:
    """FMS's RMSNorm: same math and float32 upcast as HF's Qwen2RMSNorm."""
    return LayerNormParameterized(
        dim, eps=eps, elementwise_scale=True, elementwise_shift=False,
        use_mean=False, use_high_precision_pow=True,
    )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Qwen2Rotary(PositionEncoder):
    """RoPE in HF's rotate-half layout, 1-D or M-RoPE (see module docstring).

    Holds no tensors: the inverse frequencies are recomputed from two Python
    numbers in each call (constant-folded by torch.compile), so nothing is left
    on the meta device when FMS builds the model there.
    """

    def __init__(self, head_dim: int, theta: float, mrope_section: Optional[list[int]] = None,
                 mrope_interleaved: bool = False):
        if mrope_section is not None and sum(mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {mrope_section} must sum to head_dim/2 = {head_dim // 2}")
        self.head_dim = head_dim
        self.theta = float(theta)
        self.mrope_section = list(mrope_section) if mrope_section is not None else None
        # Each frequency's axis (0 t, 1 h, 2 w), as Python numbers (nothing on
        # the meta device): contiguous sections, or interleaved (Qwen3-VL).
        self.mrope_axes: Optional[list[int]] = None
        if mrope_section is not None:
            if mrope_interleaved:
                self.mrope_axes = [
                    1 if j % 3 == 1 and j < 3 * mrope_section[1]
                    else 2 if j % 3 == 2 and j < 3 * mrope_section[2] else 0
                    for j in range(head_dim // 2)]
            else:
                self.mrope_axes = [axis % 3 for axis, size in enumerate(mrope_section)
                                   for _ in range(size)]

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """position_ids [B, T] (or [3, B, T] with M-RoPE) -> cos, sin [B, T, head_dim]."""
        dim = self.head_dim
        # Same expression and dtype as HF's compute_default_rope_parameters.
        inv_freq = 1.0 / (
            self.theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=position_ids.device) / dim)
        )
        if self.mrope_section is not None and position_ids.dim() == 2:
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)  # text only: t = h = w
        freqs = position_ids.float()[..., None] * inv_freq  # [(3,) B, T, dim/2]
        if self.mrope_axes is not None:  # each frequency from its axis: a selection
            axes = torch.tensor(self.mrope_axes, device=freqs.device)
            freqs = torch.where(axes == 0, freqs[0], torch.where(axes == 1, freqs[1], freqs[2]))
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def adjusted_qk(self, q, k, position_ids, past_kv_state=None, use_cache=False):
        """q [B, T, H, D], k [B, T, KVH, D] (MultiHeadAttention's layout)."""
        if position_ids is None:
            position_ids = torch.arange(q.shape[1], device=q.device).unsqueeze(0)
        cos, sin = self.cos_sin(position_ids, q.dtype)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # broadcast over heads
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a width split across tensor-parallel ranks: each rank holds
    its slice of the input and of the weight; the sum of squares is
    all-reduced. Same float32 math as ``rms_norm``. Slices replicated on
    several ranks (KV heads fewer than ranks) are counted once per holder on
    both sides of the mean: it divides by local width x ranks."""

    def __init__(self, local_dim: int, eps: float, group):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(local_dim))
        self.eps = eps
        self.group = group
        self.total_dim = local_dim * group.size()

    def forward(self, x):
        xf = x.float()
        sum_sq = reduce_from_tensor_model_parallel_region(
            xf.pow(2).sum(-1, keepdim=True), self.group)
        xf = xf * torch.rsqrt(sum_sq / self.total_dim + self.eps)
        return self.weight * xf.type_as(x)


class _WholeWidthQKNorm:
    """Mixin for FMS's QKV projections: RMSNorm over the full query width and
    the full key width (not per head, unlike FMS's apply_norm_per_head)."""

    def _add_qk_norm(self, eps: float, group=None) -> None:
        widths = (self.nheads * self.emb_kq_per_head, self.kvheads * self.emb_kq_per_head)
        if group is None:
            self.q_norm, self.k_norm = (rms_norm(w, eps) for w in widths)
        else:
            self.q_norm, self.k_norm = (ShardedRMSNorm(w, eps, group) for w in widths)

    def forward(self, q, k, v):
        queries, keys, values = super().forward(q, k, v)
        return self.q_norm(queries), self.k_norm(keys), values


class QKNormFusedQKV(_WholeWidthQKNorm, FusedQKV):
    pass


class QKNormUnfusedQKV(_WholeWidthQKNorm, UnfusedQKV):
    pass


class _PerHeadQKNorm:
    """Mixin for FMS's QKV projections: RMSNorm over each query and key
    head's width, one weight shared by the heads (Qwen3). FMS's own per-head
    norm exists for its unfused projection only."""

    def _add_qk_norm(self, eps: float, group=None) -> None:
        self.q_norm, self.k_norm = (rms_norm(self.emb_kq_per_head, eps) for _ in range(2))

    def forward(self, q, k, v):
        queries, keys, values = super().forward(q, k, v)
        head = self.emb_kq_per_head
        return (self.q_norm(queries.unflatten(-1, (-1, head))).flatten(-2),
                self.k_norm(keys.unflatten(-1, (-1, head))).flatten(-2), values)


class HeadNormFusedQKV(_PerHeadQKNorm, FusedQKV):
    pass


class HeadNormUnfusedQKV(_PerHeadQKNorm, UnfusedQKV):
    pass


def qkv_projection(c: Qwen2Config, nheads: int, kvheads: int, group=None) -> nn.Module:
    """Qwen2's q/k/v projection for ``nheads``/``kvheads`` heads (this rank's,
    under tensor parallelism: ``group``)."""
    fused = c.fused_weights
    if c.qk_norm or c.qk_norm_per_head:
        if c.qk_norm_per_head:
            cls = HeadNormFusedQKV if fused else HeadNormUnfusedQKV
        else:
            cls = QKNormFusedQKV if fused else QKNormUnfusedQKV
        proj = cls(
            c.emb_dim, nheads, kvheads, c.head_dim, c.head_dim, use_bias=c.attn_bias)
        proj._add_qk_norm(c.norm_eps, group)
        return proj
    return (FusedQKV if fused else UnfusedQKV)(
        c.emb_dim, nheads, kvheads, c.head_dim, c.head_dim, use_bias=c.attn_bias)


class Qwen2Attention(MultiHeadAttention):
    """FMS's attention with Qwen2's q/k/v projection. MultiHeadAttention's
    use_bias covers q/k/v *and* the output projection; Qwen2 has bias on q/k/v
    only. Built bias-free, then the q/k/v projection is swapped for one with
    bias: every parameter is then one checkpoint tensor, nothing is invented."""

    def __init__(self, config: Qwen2Config, rotary: Qwen2Rotary):
        c = config
        super().__init__(c.emb_dim, c.head_dim, c.head_dim, c.nheads, c.kvheads or c.nheads,
                         use_bias=False, position_encoder=rotary, fused=c.fused_weights)
        self.config = c
        self.in_proj = qkv_projection(c, self.nheads, self.kvheads)

    def to_tp(self, group) -> "TPQwen2Attention":
        """FMS's TensorParallelStrategy calls this (fms.utils.tp_wrapping)."""
        return TPQwen2Attention(self, group)


class TPQwen2Attention(TPMultiHeadAttention):
    """This rank's heads of a Qwen2Attention: FMS's TP attention (q/k/v rows
    and bias sharded by head, output projection by column, all-reduced) with
    Qwen2's projection; whole-width q/k norm weights sharded like their
    heads, per-head ones (one weight every head shares) whole on each rank."""

    def __init__(self, attn: Qwen2Attention, group):
        super().__init__(
            emb_dim=attn.emb_dim, emb_kq=attn.emb_kq_per_head, emb_v=attn.emb_v_per_head,
            nheads=attn.nheads, kvheads=attn.kvheads, use_bias=False,
            position_encoder=attn.position_encoder, fused=attn.fused, group=group,
        )
        self.config = attn.config
        self.in_proj = qkv_projection(attn.config, self.nheads, self.kvheads, group)

    def load_weights(self, tensor_values: dict[str, torch.Tensor]):
        if self.config.qk_norm or self.config.qk_norm_per_head:
            used: set[str] = set()
            for name, heads in (("q_norm", self.pre_tp_nheads), ("k_norm", self.pre_tp_kvheads)):
                value = self._get_sd_weight(tensor_values, used, [name, "weight"])
                weight = getattr(self.in_proj, name).weight
                if self.config.qk_norm_per_head:
                    with torch.no_grad():
                        weight.copy_(value)
                else:
                    self.sharded_copy(weight, value, 0, [heads])
            tensor_values = {k: v for k, v in tensor_values.items() if k not in used}
        return super().load_weights(tensor_values)


class Qwen2MLP(GatedLinearUnit):
    """FMS's gated MLP with an exact inner width (``hidden_dim``)."""

    def __init__(self, config: Qwen2Config):
        c = config
        # int() in GatedLinearUnit truncates emb_dim * factor: +0.5 makes the
        # float round-trip land on hidden_dim exactly.
        super().__init__(c.emb_dim, hidden_grow_factor=(c.hidden_dim + 0.5) / c.emb_dim,
                         activation_fn=str_to_activation(c.activation_fn), p_dropout=0.0,
                         use_bias=False, fused=c.fused_weights)
        assert self.hidden_dim == c.hidden_dim

    def to_tp(self, group) -> TPGatedLinearUnit:
        """FMS's own import_module passes hidden_dim / width, which int()
        can truncate by one; the +0.5 keeps each rank's share exact."""
        tp = TPGatedLinearUnit(
            self.width, hidden_grow_factor=(self.hidden_dim + 0.5) / self.width,
            activation_fn=self.a, p_dropout=self.p_dropout, use_bias=self.use_bias,
            group=group, fused=self.fused, linear_config=self.linear_config,
        )
        assert tp.hidden_dim * tp.world_size == self.hidden_dim
        return tp


class Qwen2Block(nn.Module):
    """Pre-norm decoder layer: x + attn(ln(x)), then x + mlp(ff_ln(x)); with
    ``norm_after``: x + ln(attn(x)), then x + ff_ln(mlp(x))."""

    def __init__(self, config: Qwen2Config, rotary: Qwen2Rotary):
        super().__init__()
        self.ln = rms_norm(config.emb_dim, config.norm_eps)
        self.ff_ln = rms_norm(config.emb_dim, config.norm_eps)
        self.attn = Qwen2Attention(config, rotary)
        self.norm_after = config.norm_after
        if config.num_experts:
            self.ff_sub_layer = RoutedFeedForward(
                config.num_experts, config.top_k_experts, config.emb_dim, config.hidden_dim,
                config.renormalize_experts)
        else:
            self.ff_sub_layer = Qwen2MLP(config)

    def forward(self, x, position_ids=None, past_key_value_state=None, use_cache=False,
                **attn_kwargs):
        residual = x
        out = self.attn(
            q=x if self.norm_after else self.ln(x), position_ids=position_ids,
            past_key_value_state=past_key_value_state, use_cache=use_cache, **attn_kwargs,
        )
        cache = None
        if use_cache:
            out, cache = out
        if self.norm_after:
            x = residual + self.ln(out)
            x = x + self.ff_ln(self.ff_sub_layer(x))
        else:
            x = residual + out
            x = x + self.ff_sub_layer(self.ff_ln(x))
        return (x, cache) if use_cache else x
