"""Linear layers over weights packed once (cpu device): by our kernel where
it runs (linear_kernel.py: AVX-512, or bfloat16 with AVX2 alone; a decoder's
layer without an activation to fuse, or any it can run where it widens
bfloat16: see ``pack_linear_layers``), else by oneDNN.

torch runs a float32 ``nn.Linear`` on the CPU with MKL's sgemm, a bfloat16
one with oneDNN over the plain weight. Packing each weight once into oneDNN's
blocked layout for this CPU, as vLLM's own CPU backend does
(``create_onednn_mm``), makes a decoder's linears several times faster, the
most at a decode's few rows; our kernel's own layout gains more again
(``benchmarks/linear.py``).

The oneDNN matmul is an opaque op (``vllm_accel::packed_linear``): inductor's
own lowering of oneDNN's linear takes only weights it can freeze as
constants, and ours are graph inputs (one compiled graph serves every layer).
The packed copy replaces the dense weight, so the weights' memory does not
grow (but for a head tied to the embedding, whose dense weight the embedding
keeps).

Our kernel is for the rows a decoder brings (a decode step's tens, a
prompt chunk's hundreds); an encoder's calls of thousands of rows stay
oneDNN's, whose cache blocking wins there in float32, but for bfloat16 on
AMX tiles or widened, where ours wins (``linear_kernel.runs_encoders``).

An FMS feed-forward block's activation (GELU, ReLU, SiLU) runs inside its
first matmul as a oneDNN post-op: the [rows, hidden] activations are written
once instead of three times.
GELU with tanh's approximation (SigLIP's) our kernel computes as it stores
the sums, faster than oneDNN's post-op, so that layer is ours even in an
encoder (``_KERNEL_EPILOGUES``).
Likewise a gated MLP (FMS's ``GatedLinearUnit`` with SiLU): our kernel
multiplies gate and up in one matmul and stores silu(gate) * up as it stores
the sums (``GatedUnit``), where the graph had written both, read them back and
written the product. Encoders' too, whose thousands of rows gain the most.
"""

from __future__ import annotations

import torch
from fms.modules.feedforward import FeedForwardBlock, GatedLinearUnit
from fms.modules.head import LinearClassificationHead
from torch import nn

from vllm_accel import compat
from vllm_accel.kernels import linear as linear_kernel
from vllm_accel.kernels import ops
from vllm_accel.kernels.linear import LinearKernel


def _packed_linear_shape(x, packed_weight, bias, activation="none", algorithm=""):
    return x.new_empty((*x.shape[:-1], packed_weight.shape[0]))


# packed_linear(x, oneDNN's packed weight, bias, activation, algorithm): a
# oneDNN post-op (see ``_activation_post_op``).
packed_linear = ops.define(
    'packed_linear(Tensor x, Tensor packed_weight, Tensor? bias, str activation="none", '
    'str algorithm="") -> Tensor', compat.onednn_linear, _packed_linear_shape)


def _activation_post_op(module: nn.Module) -> tuple[str, str] | None:
    """The oneDNN post-op (name, algorithm) computing ``module``, if any."""
    if type(module) is nn.ReLU:
        return "relu", ""
    if type(module) is nn.SiLU:
        return "swish", ""  # x * sigmoid(x)
    if isinstance(module, nn.GELU) and module.approximate in ("none", "tanh"):
        return "gelu", module.approximate
    return None


# oneDNN post-ops our kernel computes as it stores a layer's sums; such a
# layer runs by our kernel even in an encoder whose plain layers stay
# oneDNN's: SigLIP's fc1 with its GELU (tanh) ran faster so than by oneDNN
# with its post-op.
_KERNEL_EPILOGUES = {("gelu", "tanh"): linear_kernel.GELU_TANH}

_PACKABLE = (nn.Linear, LinearClassificationHead)


def _by_kernel(kernel: LinearKernel | None, linear: nn.Module, post_op: tuple[str, str],
               kernel_allowed: bool) -> bool:
    """Whether ``kernel`` runs ``linear`` (with ``post_op`` fused)."""
    fused_by_kernel = post_op in _KERNEL_EPILOGUES
    wanted = fused_by_kernel or (kernel_allowed and post_op[0] == "none")
    return wanted and linear_kernel.packs(kernel, linear.weight)


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight lives packed: for our kernel
    (``by_kernel``) or for oneDNN, either also running ``post_op`` (an
    activation fused in, as oneDNN names it: see ``_activation_post_op``;
    ours only those in ``_KERNEL_EPILOGUES``). ``kernel_allowed``: whether
    our kernel may run it without an activation."""

    def __init__(self, linear: nn.Linear, kernel: LinearKernel | None = None,
                 post_op: tuple[str, str] = ("none", ""), kernel_allowed: bool = True):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.post_op = post_op
        self.epilogue = _KERNEL_EPILOGUES.get(post_op, linear_kernel.PLAIN)
        self.by_kernel = _by_kernel(kernel, linear, post_op, kernel_allowed)
        weight = (kernel.pack(linear.weight) if self.by_kernel
                  else compat.onednn_pack_linear_weight(linear.weight))
        self.register_buffer("packed_weight", weight, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.by_kernel:
            return linear_kernel.linear(x, self.packed_weight, self.bias, self.out_features,
                                        self.epilogue)
        return packed_linear(x, self.packed_weight, self.bias, *self.post_op)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, by_kernel={self.by_kernel}, " \
               f"post_op={self.post_op[0]}"


class GatedUnit(nn.Module):
    """An FMS ``GatedLinearUnit`` with SiLU whose silu(gate) * up our kernel
    computes in one matmul of gate and up together (``linear_kernel.pack_gated``);
    then ``w2``, packed as any layer."""

    by_kernel = True  # always our kernel's (as PackedLinear.by_kernel says of a layer)

    def __init__(self, glu: GatedLinearUnit, kernel: LinearKernel):
        super().__init__()
        self.hidden_dim = glu.hidden_dim
        weight, bias = kernel.pack_gated(*self.gate_and_up_weights(glu))
        self.register_buffer("packed_weight", weight, persistent=False)
        self.register_buffer("packed_bias", bias, persistent=False)
        self.w2 = glu.w2

    @staticmethod
    def gate_and_up(glu: GatedLinearUnit) -> list[nn.Module]:
        """The layers computing gate and up: the fused one, or the two."""
        return [glu.wg1_fused] if glu.fused else [glu.wg, glu.w1]

    @staticmethod
    def gate_and_up_weights(glu: GatedLinearUnit) -> tuple:
        """(gate weight, up weight, gate bias, up bias): FMS's fused layer
        holds gate's rows first."""
        if not glu.fused:
            return glu.wg.weight, glu.w1.weight, glu.wg.bias, glu.w1.bias
        layer, h = glu.wg1_fused, glu.hidden_dim
        biases = (None, None) if layer.bias is None else (layer.bias[:h], layer.bias[h:])
        return layer.weight[:h], layer.weight[h:], *biases

    @staticmethod
    def fits(module: nn.Module, kernel: LinearKernel | None) -> bool:
        """An FMS gated MLP this replaces: SiLU, no dropout, gate and up by
        plain nn.Linears our kernel runs (both with a bias or neither), and
        GatedLinearUnit's own forward (not the tensor-parallel one's, which
        all-reduces)."""
        if not (isinstance(module, GatedLinearUnit)
                and type(module).forward is GatedLinearUnit.forward
                and type(module.a) is nn.SiLU and not module.p_dropout):
            return False
        layers = GatedUnit.gate_and_up(module)
        return (all(type(layer) is nn.Linear and linear_kernel.packs(kernel, layer.weight)
                    for layer in layers)
                and len({layer.bias is None for layer in layers}) == 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = linear_kernel.linear(x, self.packed_weight, self.packed_bias, self.hidden_dim,
                                     linear_kernel.GATED_SILU)
        return self.w2(gated)

    def extra_repr(self) -> str:
        return f"hidden_dim={self.hidden_dim}, silu(gate) * up by the kernel"


def pack_linear_layers(model: nn.Module, kernel: LinearKernel | None,
                       decoder: nn.Module | None = None) -> int:
    """Replace every linear layer of ``model`` (text, vision and head) by a
    ``PackedLinear``, each FMS ``FeedForwardBlock``'s activation fused into
    its first, and each gated MLP (SiLU) a ``GatedUnit`` where ``kernel``
    (ours; None: none) runs it; returns how many layers. Our kernel may run
    the layers of ``decoder`` (a part of ``model``; None: all of it), the
    others stay oneDNN's (see the
    module's docstring). Where oneDNN does not pack the model's dtype
    (bfloat16 on a CPU with AVX2 alone), only the layers our kernel runs are
    replaced, an encoder's too (torch's own matmul, the alternative, is
    several times slower: linear_kernel.cpp), and the rest left as they are.
    Where our kernel widens bfloat16 (a CPU without its instructions), it
    runs every layer it can, an encoder's too: oneDNN's bfloat16 there is
    emulated, several times slower than ours (benchmarks/README.md). So it does
    where it multiplies bfloat16 on AMX tiles (``linear_kernel.runs_encoders``)."""
    dtype = next(model.parameters()).dtype
    onednn = compat.onednn_packs_dtype(dtype)
    if not onednn and not linear_kernel.runs(kernel, dtype):
        return 0
    kernel_first = not onednn or linear_kernel.runs_encoders(kernel, dtype)
    # Gated MLPs, an encoder's too: silu(gate) * up by our kernel (GatedUnit).
    gated = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (GatedUnit.fits(child, kernel)
                    and GatedUnit.gate_and_up(child)[0].weight.dtype == dtype):
                setattr(parent, name, GatedUnit(child, kernel))
                gated += 1
    # a(w1(x)) -> w1(x) with a post-op, where oneDNN has the activation.
    post_ops, fused = {}, []
    for block in model.modules():
        if isinstance(block, FeedForwardBlock) and type(block.w1) in _PACKABLE:
            post_op = _activation_post_op(block.a)
            if post_op is not None and (not kernel_first or post_op in _KERNEL_EPILOGUES):
                post_ops[id(block.w1)] = post_op
                fused.append(block)
    # Only layers that are called, never read: plain nn.Linear and FMS's LM
    # head class (its TP variant all-reduces). A subclass may be read by its
    # owner (nn.MultiheadAttention reads its out_proj's weight).
    decoder_layers = {id(m) for m in (decoder or model).modules()}
    packed: dict[int, PackedLinear] = {}  # by id of the linear: a layer may have two parents
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in _PACKABLE and child.weight.dtype == dtype:
                if id(child) not in packed:
                    post_op = post_ops.get(id(child), ("none", ""))
                    allowed = id(child) in decoder_layers or kernel_first
                    if not onednn and not _by_kernel(kernel, child, post_op, allowed):
                        continue  # neither packs it: torch's own
                    packed[id(child)] = PackedLinear(child, kernel, post_op,
                                                     kernel_allowed=allowed)
                setattr(parent, name, packed[id(child)])
    for block in fused:
        if isinstance(block.w1, PackedLinear):  # not a layer of another dtype, left dense
            block.a = nn.Identity()
    return len(packed) + gated
