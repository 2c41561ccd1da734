"""Mixture-of-experts feed-forward layers: FMS's ``MOEFeedForward`` replaced at
load by ``Experts``, which runs fast on the cpu device, compiles whole (static
shapes, no graph break) and runs under FMS's tensor parallelism.

What FMS does (ibm-fms 1.13.1, ``fms/modules/feedforward.py``): the router
(``gate``, softmax in the model's dtype, top-k, weights renormalized) feeds
``ConditionalFeedForward``, whose two matmuls are FMS's custom op
``moe::moe_mm``: a Triton kernel on CUDA; on the CPU a loop over every expert
that picks its rows with a boolean mask (a sum and a host sync per expert),
after computing a block alignment only the Triton kernel reads. Under tensor
parallelism FMS's strategy swaps in ``TPConditionalFeedForward`` (each rank
holds a slice of every expert's intermediate dimension), whose ``forward``
takes ``(x, expert_indices)`` while ``MOEFeedForward`` calls it with three
arguments: the first call fails.

``Experts`` keeps FMS's router weights and expert weights (a rank's slice of
them under TP) and computes:

- the routing in the graph, with static shapes: logits [tokens, experts],
  softmax in float32 (as HF's classes do), top-k, the k weights renormalized
  to sum to one, or kept as the softmax over all experts gave them where the
  layer is a ``RoutedFeedForward`` built with ``renormalize=False`` (OLMoE's
  ``norm_topk_prob=false``: FMS's own layer always renormalizes);
- on the cpu device, the experts as one opaque op (``vllm_accel::experts``):
  the routed (token, expert) pairs sorted by expert, each expert multiplying
  only its own rows, with its weights packed once at load as the linear
  layers' are (model/packed_linear.py): by our kernel where it runs the
  dtype (gate and up in one call that stores silu(gate) * up), else oneDNN,
  else torch's own matmul. The rows that only pad a bucket are not routed
  (``ForwardContext.live_rows``). The op's output is [tokens, hidden] whatever
  the routing, so the compiled graph is static; the grouping, whose sizes
  depend on the routing, happens inside the op, eagerly;
- elsewhere (cuda), the experts dense in the graph: every expert over every
  token, scaled by the token's routing weight for it (zero where not
  routed): no host sync, so CUDA graphs can capture it, at experts / top-k
  times the arithmetic;
- under TP each rank computes its slice's partial sums and all-reduces them
  (the router is whole on every rank: every rank routes alike).

FMS's experts with biases (GPT-OSS's) compute another activation, on gate
and up rows interleaved: gate clamped above at ``swiglu_limit``, up clamped
to +-limit, ``gate * sigmoid(1.702 * gate) * (up + 1)``. ``Experts`` takes
their rows apart at load (gate rows first, as for the others), adds each
expert's biases and computes that activation. FMS's tensor-parallel experts
load no biases: GPT-OSS refuses tensor parallelism (architectures.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fms.distributed.tensorparallel import reduce_from_tensor_model_parallel_region
from fms.modules.feedforward import (
    ConditionalFeedForward,
    MOEFeedForward,
    TPConditionalFeedForward,
)
from fms.modules.tp import TPModule
from torch import nn

from vllm_accel import compat
from vllm_accel.forward_context import get_forward_context
from vllm_accel.kernels import linear as linear_kernel
from vllm_accel.kernels import ops
from vllm_accel.kernels.linear import LinearKernel
from vllm_accel.log import get_logger

logger = get_logger(__name__)

# How an expert's weights are held and multiplied: packed for our linear
# kernel (gate and up as one gated weight), packed for oneDNN, plain (torch's
# matmul: [2 * intermediate, hidden] and [hidden, intermediate]); or all
# experts dense in the graph (no op).
KERNEL, ONEDNN, TORCH, DENSE = "kernel", "onednn", "torch", "dense"
_OP_FORMS = {KERNEL: 0, ONEDNN: 1, TORCH: 2}


# FMS's clamped SwiGLU slope (ConditionalFeedForward.clamp_swiglu).
SWIGLU_ALPHA = 1.702


def gated(gate: torch.Tensor, up: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """The experts' activation: SiLU-gated (``swiglu_limit`` None), else
    GPT-OSS's clamped SwiGLU."""
    if swiglu_limit is None:
        return F.silu(gate) * up
    gate = gate.clamp(max=swiglu_limit)
    up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return gate * torch.sigmoid(gate * SWIGLU_ALPHA) * (up + 1)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            out_features: int, form: int) -> torch.Tensor:
    if form == _OP_FORMS[KERNEL]:
        return get_forward_context().kernels.linear(x, weight, bias, out_features)
    if form == _OP_FORMS[ONEDNN]:
        return compat.onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _expert(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
            gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
            intermediate: int, form: int, swiglu_limit: float | None) -> torch.Tensor:
    """One expert over its ``rows`` [n, hidden] -> [n, hidden]."""
    if form == _OP_FORMS[KERNEL]:
        assert get_forward_context().kernels.linear is not None, \
            "experts packed for the linear kernel run inside set_forward_context with that kernel"
    hidden = rows.shape[1]
    if form == _OP_FORMS[KERNEL] and swiglu_limit is None and gate_up_bias is None:
        # gate and up packed as one weight, SiLU(gate) * up in the kernel
        activated = get_forward_context().kernels.linear(
            rows, gate_up, None, intermediate, linear_kernel.GATED_SILU)
        return _linear(activated, down, down_bias, hidden, form)
    gate, up = _linear(rows, gate_up, gate_up_bias, 2 * intermediate, form).split(
        intermediate, dim=-1)
    return _linear(gated(gate, up, swiglu_limit), down, down_bias, hidden, form)


def _experts(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
             gate_up: list[torch.Tensor], down: list[torch.Tensor],
             gate_up_bias: list[torch.Tensor], down_bias: list[torch.Tensor], intermediate: int,
             form: int, swiglu_limit: float | None) -> torch.Tensor:
    """x [tokens, hidden]; expert_ids [tokens, k] (int64) and expert_weights
    [tokens, k] (float32): each token's experts and their weights. Returns
    [tokens, hidden]: each token's experts' outputs, weighted and summed in
    float32 (in expert order, as HF's classes add them); rows that only pad
    a bucket are zero. ``gate_up_bias``/``down_bias``: each expert's biases
    (empty: none)."""
    tokens, top_k = expert_ids.shape
    live = get_forward_context().rows_to_compute(tokens)
    out = torch.zeros(tokens, x.shape[1], dtype=torch.float32, device=x.device)
    ids = expert_ids[:live].reshape(-1)
    order = torch.argsort(ids, stable=True)  # pairs grouped by expert, tokens in order
    counts = torch.bincount(ids, minlength=len(gate_up)).tolist()
    token_of = order // top_k
    weight_of = expert_weights[:live].reshape(-1)[order]
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        token = token_of[start:start + count]
        y = _expert(x.index_select(0, token), gate_up[expert], down[expert],
                    gate_up_bias[expert] if gate_up_bias else None,
                    down_bias[expert] if down_bias else None, intermediate, form, swiglu_limit)
        out.index_add_(0, token, y.float() * weight_of[start:start + count, None])
        start += count
    return out.to(x.dtype)


def _experts_shape(x, expert_ids, expert_weights, gate_up, down, gate_up_bias, down_bias,
                   intermediate, form, swiglu_limit):
    return x.new_empty(x.shape)


# experts(x, expert_ids, expert_weights, each expert's gate/up weight, each
# expert's down weight, their biases (or none), intermediate size, form,
# clamped SwiGLU limit (None: SiLU)) -> [tokens, hidden]
experts_op = ops.define(
    "experts(Tensor x, Tensor expert_ids, Tensor expert_weights, Tensor[] gate_up, "
    "Tensor[] down, Tensor[] gate_up_bias, Tensor[] down_bias, int intermediate, int form, "
    "float? swiglu_limit) -> Tensor", _experts, _experts_shape)


def dense_experts(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
                  w13: torch.Tensor, w2: torch.Tensor, w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None,
                  swiglu_limit: float | None = None) -> torch.Tensor:
    """Every expert over every token, each token's outputs scaled by its
    routing weights (zero for an expert it is not routed to): static
    torch code. w13 [experts, 2 * intermediate, hidden] (gate rows first),
    w2 [experts, hidden, intermediate]; biases [experts, out] or None."""
    routing = torch.zeros(x.shape[0], w13.shape[0], dtype=torch.float32, device=x.device)
    routing = routing.scatter(1, expert_ids, expert_weights)  # [tokens, experts]
    h = torch.einsum("td,ehd->eth", x, w13)
    if w13_bias is not None:
        h = h + w13_bias[:, None, :]
    gate, up = h.chunk(2, dim=-1)
    y = torch.bmm(gated(gate, up, swiglu_limit), w2.transpose(1, 2))  # [experts, tokens, hidden]
    if w2_bias is not None:
        y = y + w2_bias[:, None, :]
    return (y.float() * routing.t().unsqueeze(-1)).sum(0).to(x.dtype)


def route(logits: torch.Tensor, top_k: int, topk_first: bool = False,
          renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [tokens, experts] -> (expert ids [tokens, k], their
    weights [tokens, k] float32): the softmax of the top-k logits
    (``topk_first``), else the top k of the softmax over all experts,
    renormalized to sum to one or not."""
    logits = logits.float()
    if topk_first:
        top, ids = torch.topk(logits, top_k, dim=-1)
        return ids, F.softmax(top, dim=-1)
    weights, ids = torch.topk(F.softmax(logits, dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


class RoutedFeedForward(MOEFeedForward):
    """FMS's MoE layer with the routing choice FMS's layer lacks: ``renormalize``
    False keeps the top-k weights as the softmax over all experts gave them.
    FMS's strategy shards it as FMS's own (its ``cond_ffn``). Its own forward
    computes every expert densely (correct, slow); the loader replaces it by
    ``Experts``."""

    def __init__(self, num_experts: int, top_k: int, dim: int, intermediate_size: int,
                 renormalize: bool = True):
        super().__init__(num_experts, top_k, dim, intermediate_size)
        self.renormalize = renormalize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.dim)
        ids, weights = route(self.gate(rows), self.num_activated_experts,
                             renormalize=self.renormalize)
        out = dense_experts(rows, ids, weights, self.cond_ffn.w13, self.cond_ffn.w2)
        if isinstance(self.cond_ffn, TPModule):
            out = reduce_from_tensor_model_parallel_region(out, self.cond_ffn.group)
        return out.view(x.shape)


def supported(moe: nn.Module) -> bool:
    """An FMS MoE layer ``Experts`` computes exactly: FMS's own expert module,
    or its TP form for experts without biases (it loads no biases)."""
    cond = getattr(moe, "cond_ffn", None)
    return isinstance(moe, MOEFeedForward) and (
        type(cond) is ConditionalFeedForward
        or (type(cond) is TPConditionalFeedForward and not cond.use_bias))


def _gate_rows_first(rows: torch.Tensor) -> torch.Tensor:
    """Each expert's interleaved gate/up rows (dim 1: gate 0, up 0, gate 1,
    ...) -> its gate rows, then its up rows (weights and biases alike)."""
    return torch.cat([rows[:, 0::2], rows[:, 1::2]], dim=1)


def choose_form(w13: torch.Tensor, w2: torch.Tensor, kernel: LinearKernel | None) -> str:
    """How to run experts of these weights: the op on the cpu device (by our
    kernel where it packs both weights, else oneDNN where it packs the
    dtype, else torch), dense elsewhere."""
    if w13.device.type != "cpu":
        return DENSE
    if linear_kernel.packs(kernel, w13[0]) and linear_kernel.packs(kernel, w2[0]):
        return KERNEL
    if compat.onednn_packs_dtype(w13.dtype):
        return ONEDNN
    return TORCH


class Experts(nn.Module):
    """FMS's ``MOEFeedForward`` (its weights taken over) computed as this
    module's docstring says; ``form``: see ``choose_form``."""

    def __init__(self, moe: MOEFeedForward, form: str, kernel: LinearKernel | None = None):
        super().__init__()
        if not supported(moe):
            raise ValueError(f"Experts does not compute this MoE layer: {moe}")
        cond = moe.cond_ffn
        self.gate = moe.gate  # the router: [experts, hidden], whole on every rank
        self.hidden = moe.dim
        self.num_experts = cond.num_experts
        self.top_k = moe.num_activated_experts
        self.topk_first = bool(moe.topk_first)
        self.renormalize = getattr(moe, "renormalize", True)  # FMS's own layer: always
        self.intermediate = cond.intermediate_size  # this rank's slice under TP
        self.group = cond.group if isinstance(cond, TPModule) else None
        self.form = form
        w13, w2 = cond.w13.detach(), cond.w2.detach()
        # FMS's biased experts compute the clamped SwiGLU on interleaved rows
        # (None: SiLU on gate rows first).
        self.biased = bool(cond.use_bias)
        self.swiglu_limit = None
        w13_bias = w2_bias = None
        if self.biased:
            limit = cond.swiglu_limit
            self.swiglu_limit = float("inf") if limit is None else float(limit)
            w13 = _gate_rows_first(w13)
            w13_bias = _gate_rows_first(cond.w13_bias.detach())
            w2_bias = cond.w2_bias.detach()
        if form == DENSE:
            self.register_buffer("w13", w13, persistent=False)
            self.register_buffer("w2", w2, persistent=False)
            self.register_buffer("w13_bias", w13_bias, persistent=False)
            self.register_buffer("w2_bias", w2_bias, persistent=False)
            return
        for expert in range(self.num_experts):
            gate_up, down = w13[expert], w2[expert]
            if form == KERNEL and not self.biased:
                gate_up = kernel.pack_gated(gate_up[:self.intermediate],
                                            gate_up[self.intermediate:])[0]
                down = kernel.pack(down)
            elif form == KERNEL:
                gate_up, down = kernel.pack(gate_up), kernel.pack(down)
            elif form == ONEDNN:
                gate_up = compat.onednn_pack_linear_weight(gate_up)
                down = compat.onednn_pack_linear_weight(down)
            self.register_buffer(f"gate_up_{expert}", gate_up, persistent=False)
            self.register_buffer(f"down_{expert}", down, persistent=False)
            if self.biased:
                self.register_buffer(f"gate_up_bias_{expert}", w13_bias[expert], persistent=False)
                self.register_buffer(f"down_bias_{expert}", w2_bias[expert], persistent=False)

    def route(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [tokens, hidden] -> (expert ids [tokens, k], their weights
        [tokens, k] float32)."""
        return route(self.gate(rows), self.top_k, self.topk_first, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.hidden)
        ids, weights = self.route(rows)
        if self.form == DENSE:
            out = dense_experts(rows, ids, weights, self.w13, self.w2, self.w13_bias,
                                self.w2_bias, self.swiglu_limit)
        else:
            experts = range(self.num_experts)
            biases = experts if self.biased else ()
            out = experts_op(rows.contiguous(), ids, weights,
                             [getattr(self, f"gate_up_{e}") for e in experts],
                             [getattr(self, f"down_{e}") for e in experts],
                             [getattr(self, f"gate_up_bias_{e}") for e in biases],
                             [getattr(self, f"down_bias_{e}") for e in biases],
                             self.intermediate, _OP_FORMS[self.form], self.swiglu_limit)
        if self.group is not None:
            out = reduce_from_tensor_model_parallel_region(out, self.group)
        return out.view(x.shape)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden}, "
                f"intermediate={self.intermediate}, form={self.form}, "
                f"renormalize={self.renormalize}, biased={self.biased}, "
                f"swiglu_limit={self.swiglu_limit}, "
                f"tensor_parallel={self.group is not None}")


def install(model: nn.Module, kernel: LinearKernel | None = None) -> int:
    """Replace every MoE layer of ``model`` that ``Experts`` computes by one
    (``kernel``: ours, if the engine runs it; None: none); returns how many.
    Before the linear layers are packed (the router is one of them)."""
    replaced, forms = 0, set()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, MOEFeedForward):
                continue
            if not supported(child):
                logger.warning("vllm_accel: MoE layer %s kept FMS's forward (tensor-parallel "
                               "experts with biases)", name)
                continue
            form = choose_form(child.cond_ffn.w13, child.cond_ffn.w2, kernel)
            setattr(parent, name, Experts(child, form, kernel))
            replaced += 1
            forms.add(form)
    if replaced:
        logger.info("vllm_accel mixture-of-experts layers: %d (experts %s)", replaced,
                    ", ".join(sorted(forms)))
    return replaced
