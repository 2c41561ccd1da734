"""Linear layers by our kernel (linear_kernel.cpp) on a CPU with AVX-512
(bfloat16 by AVX-512 BF16 dot products, on AMX tiles where the CPU has them,
or widened to float32 in registers where it has neither) or with AVX2 alone
(bfloat16 widened too).

oneDNN's packed matmul leaves DRAM idle while it computes a block's rows
after the first; ours streams the weights in meanwhile, which is what a
decode step's few rows are bound by (figures: benchmarks/README.md).
A layer runs by it where ``packs`` says yes, it has no activation to fuse
(those keep oneDNN's post-ops) and it is not an encoder's (see
model/packed_linear.py); a gated MLP's (SiLU), an encoder's too, runs gate
and up in one call that stores silu(gate) * up (``LinearKernel.pack_gated``),
and a layer followed by GELU's tanh approximation (SigLIP's fc1) stores its
GELU (``GELU_TANH``). Rows that only pad a bucket are not multiplied
(``ForwardContext.live_rows``: a forward's tokens past the step's, a
Qwen2.5-VL encoder call's patches past its images').
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from vllm_accel.log import get_logger
from vllm_accel.forward_context import get_forward_context
from vllm_accel.kernels import build, ops

logger = get_logger(__name__)

SOURCE = Path(__file__).with_name("linear_kernel.cpp")
_PAIRED = {torch.float32: 1, torch.bfloat16: 2}  # elements along K per multiply

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p

# What the kernel stores of x @ w.T + bias (linear_kernel.cpp's Epilogue):
# the sums; silu(gate) * up of a weight packed by ``pack_gated``; gelu(sums)
# with tanh's approximation.
PLAIN, GATED_SILU, GELU_TANH = 0, 1, 2


class LinearKernel:
    """The kernel's entry points, loaded from a built shared library;
    ``runs``: the dtypes its build runs on this CPU, ``dtypes``: those layers
    run by it (set by ``build.load``); ``multiplies_on_amx``: bfloat16
    on AMX tiles (its own layout: ``layout``)."""

    def __init__(self, library: Path):
        loaded = ctypes.CDLL(str(library))
        self._functions = {torch.float32: loaded.linear_f32, torch.bfloat16: loaded.linear_bf16}
        for function in self._functions.values():
            function.restype = ctypes.c_int
            function.argtypes = [_PTR] * 4 + [_I64] * 3 + [ctypes.c_int] * 2
        self.multiplies_on_amx = bool(loaded.bf16_on_amx())
        self._copies_x = loaded.amx_copies_x
        self._copies_x.argtypes = [_I64, _I64, ctypes.c_int]
        self.widens_bfloat16 = bool(loaded.bf16_widened())  # no bfloat16 instructions
        self.vector_lanes = loaded.vector_lanes()  # 16: AVX-512, 8: AVX2 alone
        self._layouts = {dtype: (loaded.packed_block_columns(int(dtype == torch.bfloat16)),
                                 loaded.packed_k_multiple(int(dtype == torch.bfloat16)))
                         for dtype in self._functions}
        # No layout (0 columns a block): built without that dtype; status 2:
        # without the instructions it needs; 3: the OS refused AMX.
        self.runs = {dtype for dtype in self._functions
                     if self.layout(dtype)[0]
                     and self._run(torch.zeros(1, 2, dtype=dtype),
                                   self.pack(torch.zeros(1, 2, dtype=dtype)), None, 1)[1] == 0}
        self.dtypes: set[torch.dtype] = set()

    def layout(self, dtype: torch.dtype) -> tuple[int, int]:
        """(output columns per packed block, multiple K is padded to), as the
        build multiplies: 64 and 1 or 2 (float32, bfloat16) with AVX-512, 32
        and 1 or 2 with AVX2, 32 and 32 on AMX tiles (bfloat16)."""
        return self._layouts[dtype]

    def copies_x_into_tiles(self, rows: int, out_features: int, epilogue: int = PLAIN) -> bool:
        """Whether the AMX kernel copies x into its tiles before multiplying
        such a call (an encoder's MLP: linear_kernel.cpp, kTiledRows)."""
        return bool(self._copies_x(rows, out_features, epilogue))

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [out, in] -> blocks [out / B, in / P, B, P] (B columns per
        block, P: 1 float32, 2 bfloat16; see ``layout``), the last block's
        missing columns zero, and ``in`` padded with zeros to the layout's
        multiple."""
        out_features, in_features = weight.shape
        block, k_multiple = self.layout(weight.dtype)
        paired = _PAIRED[weight.dtype]
        padded = weight.new_zeros(-(-out_features // block) * block,
                                  -(-in_features // k_multiple) * k_multiple)
        padded[:out_features, :in_features] = weight.detach()
        blocks = padded.view(-1, block, padded.shape[1] // paired, paired)
        return blocks.permute(0, 2, 1, 3).contiguous()

    def pack_gated(self, gate: torch.Tensor, up: torch.Tensor,
                   gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A gate and its up projection, each weight [out, in], packed as one
        whose blocks hold half a block of gate columns and the same columns of
        up: the kernel then stores silu(gate) * up ([rows, out]). The bias
        (if any) in the packed columns' order, as the kernel reads it."""
        half = self.layout(gate.dtype)[0] // 2
        blocks = -(-gate.shape[0] // half)

        def interleaved(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
            """Per block, half rows of g then the same rows of u (zeros past out)."""
            rest = g.shape[1:]
            padded = g.new_zeros(2, blocks * half, *rest)  # [gate / up, padded rows, ...]
            padded[0, :g.shape[0]], padded[1, :u.shape[0]] = g.detach(), u.detach()
            return padded.view(2, blocks, half, *rest).transpose(0, 1).reshape(-1, *rest)

        bias = None if gate_bias is None else interleaved(gate_bias, up_bias)
        return self.pack(interleaved(gate, up)), bias

    def _run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             out_features: int, epilogue: int = PLAIN, out: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, int]:
        """x [rows, in] contiguous -> ([rows, out_features], into ``out`` where
        given: contiguous; the kernel's status)."""
        rows, in_features = x.shape
        y = x.new_empty(rows, out_features) if out is None else out
        status = self._functions[x.dtype](
            x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
            y.data_ptr(), rows, out_features, in_features, epilogue, torch.get_num_threads())
        return y, status

    def __call__(self, x, weight, bias, out_features, epilogue=PLAIN, out=None):
        y, status = self._run(x, weight, bias, out_features, epilogue, out)
        if status:
            raise RuntimeError(f"linear kernel refused x {list(x.shape)} {x.dtype} "
                               f"(status {status})")
        return y


def load(cache_dir: Path) -> LinearKernel | None:
    """The kernel (built into ``cache_dir`` if missing), or None where it
    cannot be built or this CPU has neither AVX-512 nor AVX2 (logged): linear
    layers then stay oneDNN's."""
    kernel = build.load(LinearKernel, SOURCE, cache_dir, "linear layers stay oneDNN's")
    if kernel is not None and kernel.vector_lanes == 8:
        # AVX2 alone: ours runs bfloat16 (which oneDNN cannot pack there);
        # float32 stays oneDNN's, faster than ours at every row count there.
        kernel.dtypes.discard(torch.float32)
        logger.info("vllm_accel: linear kernel in bfloat16 only (AVX2), float32 stays oneDNN's")
    return kernel


def runs(kernel: LinearKernel | None, dtype: torch.dtype) -> bool:
    """Whether ``kernel`` (None: no kernel) runs layers of ``dtype``."""
    return kernel is not None and dtype in kernel.dtypes


def runs_encoders(kernel: LinearKernel | None, dtype: torch.dtype) -> bool:
    """Whether ``kernel`` runs an encoder's layers of ``dtype`` too, not only a
    decoder's: bfloat16 where it widens it to float32 (a CPU without bfloat16
    instructions: oneDNN's own, if any, is emulated and slower than ours at
    every size), or multiplies it on AMX tiles (one row group a pass beat
    oneDNN's packed matmul at the vision towers' shapes: benchmarks/README.md)."""
    return (runs(kernel, dtype) and dtype == torch.bfloat16
            and (kernel.widens_bfloat16 or kernel.multiplies_on_amx))


def packs(kernel: LinearKernel | None, weight: torch.Tensor) -> bool:
    """Whether ``kernel`` runs a layer of this weight [out, in]."""
    return (runs(kernel, weight.dtype) and weight.device.type == "cpu"
            and weight.shape[1] % _PAIRED[weight.dtype] == 0)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            out_features: int, epilogue: int = PLAIN) -> torch.Tensor:
    context = get_forward_context()
    kernel = context.kernels.linear
    assert kernel is not None, \
        "a layer packed for the linear kernel runs inside set_forward_context with that kernel"
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    bias = None if bias is None else bias.contiguous()
    live = context.rows_to_compute(rows.shape[0])
    if live == rows.shape[0]:
        y = kernel(rows, weight, bias, out_features, epilogue)
    else:  # padding rows (a bucket's: ForwardContext.live_rows) are not multiplied, left zero
        y = rows.new_empty(rows.shape[0], out_features)
        kernel(rows[:live], weight, bias, out_features, epilogue, out=y[:live])
        y[live:].zero_()
    return y.view(*x.shape[:-1], out_features)


def _linear_shape(x, weight, bias, out_features, epilogue=PLAIN):
    return x.new_empty((*x.shape[:-1], out_features))


# linear(x [..., in], the packed weight, bias or None, out_features, epilogue)
# -> [..., out_features]; epilogue: PLAIN, GATED_SILU or GELU_TANH (above).
linear = ops.define("blocked_linear(Tensor x, Tensor weight, Tensor? bias, int out_features, "
                    "int epilogue=0) -> Tensor", _linear, _linear_shape)
