"""Our C++ CPU kernels: their sources, their build, their ops and the Python
wrappers around them.

- ``linear_kernel.cpp`` / ``linear.py``: linear layers over weights packed
  once at load (AVX-512, AMX tiles for bfloat16, AVX2 with bfloat16 widened);
- ``decode_attention.cpp`` / ``decode_attention.py``: each decode row over
  its KV blocks read in place, and the step's KV writes;
- ``span_attention.cpp`` / ``span_attention.py``: attention over a call's own
  tokens (vision towers, a prompt's causal attention);
- ``vector_math.h``, ``amx_tiles.h``: what those sources share;
- ``build.py``: compiling them on the user's machine into the compile cache;
- ``ops.py``: our ops in torch's registry (opaque to the compilers).

The model loader makes one call, ``load``, and puts the ``CpuKernels`` it gets
into every forward's context (forward_context.py); the ops read them there.
Where a kernel is missing (no compiler, a CPU it has no instructions for, or
the ``cpu_kernels`` setting off) the layers run oneDNN's packed matmul and
torch's attention instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_accel.kernels.decode_attention import DecodeAttentionKernel
    from vllm_accel.kernels.linear import LinearKernel
    from vllm_accel.kernels.span_attention import SpanAttentionKernel


@dataclass(frozen=True)
class CpuKernels:
    """The kernels an engine runs (None: that work stays oneDNN's or torch's)."""

    linear: LinearKernel | None = None
    span: SpanAttentionKernel | None = None
    decode: DecodeAttentionKernel | None = None


NO_KERNELS = CpuKernels()


def start_building(cache_dir: Path) -> None:
    """Start building every kernel in the background (while weights load)."""
    from vllm_accel.kernels import build, decode_attention, linear, span_attention

    build.build_in_background([linear.SOURCE, decode_attention.SOURCE, span_attention.SOURCE],
                              cache_dir)


def load(cache_dir: Path) -> CpuKernels:
    """Every kernel this CPU runs, built into ``cache_dir`` if missing (each
    one that cannot be built or run is None, logged)."""
    from vllm_accel.kernels import decode_attention, linear, span_attention

    return CpuKernels(linear=linear.load(cache_dir), span=span_attention.load(cache_dir),
                      decode=decode_attention.load(cache_dir))
