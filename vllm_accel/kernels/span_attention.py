"""Attention over a call's own tokens on the CPU, by our kernel
(span_attention.cpp): each query row attends to a span of the keys (all of its
image, its frame or window, or, causal, the tokens up to its own).

torch's CPU flash kernel runs a vision tower's attention far below its
matmuls' rate; the kernel runs the towers' shapes and a prompt's causal
attention several times faster in bfloat16, as accurately, and faster in
float32 too (``benchmarks/span_attention.py``). A CPU with AVX-512 but no
BF16 runs bfloat16 widened to float32 in registers; where the build has AMX,
bfloat16 multiplies on its tiles.

SigLIP, Molmo's ViT and the paged attention op for prompts call ``attend``
where ``supported`` says yes and keep their own attention otherwise (CUDA, a
CPU without AVX-512, a head size above 128, bfloat16 on a CPU with AMX where
the kernel was built without AMX: build.py, or no kernel in the forward's
context). Qwen2.5-VL's tower calls it on every CPU: where the kernel does not
run, ``attend`` runs torch's SDPA span by span, not masked over the whole
call. The op is opaque to inductor, so every compiled graph calls it; which
kernel it runs is the forward context's (``ForwardContext.kernels``).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F
from fms.modules import attention as fms_attention

from vllm_accel.log import get_logger
from vllm_accel.forward_context import get_forward_context
from vllm_accel.kernels import build, ops

logger = get_logger(__name__)

SOURCE = Path(__file__).with_name("span_attention.cpp")
MAX_HEAD_DIM = 128

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class SpanAttentionKernel:
    """The kernel's entry points (bfloat16, float32), loaded from a built
    shared library; ``runs``: the dtypes its build runs on this CPU,
    ``dtypes``: those attention runs by it (set by ``build.load``);
    ``multiplies_on_amx``: bfloat16 on AMX tiles (span_attention.cpp)."""

    def __init__(self, library: Path):
        loaded = ctypes.CDLL(str(library))
        # bfloat16 on AMX tiles where built with them (AVX-512 BF16 dot
        # products alone lose to torch's SDPA on such a CPU: build.py).
        self.multiplies_on_amx = bool(loaded.bf16_on_amx())
        self._functions = {torch.bfloat16: loaded.span_attention_bf16,
                           torch.float32: loaded.span_attention_f32}
        for function in self._functions.values():
            function.restype = ctypes.c_int
            function.argtypes = ([_PTR] * 4 + [_I64] * 6 + [_PTR, ctypes.c_int] + [_I64] * 6
                                 + [ctypes.c_float, ctypes.c_int])
        # Status 2: built without the instructions that dtype needs; 5: the OS
        # refused AMX.
        probes = {dtype: torch.zeros(1, 1, 1, 2, dtype=dtype) for dtype in self._functions}
        self.runs = {dtype for dtype, probe in probes.items()
                     if self._run(probe, probe, probe, None, 1.0)[1] not in (2, 5)}
        self.dtypes: set[torch.dtype] = set()
        self.calls = 0  # one per attention layer run (tests count them)

    def _run(self, q, k, v, ranges, scale, causal=False):
        """(output, the kernel's status)."""
        batch, n, heads, dim = q.shape
        out = torch.empty(q.shape, dtype=q.dtype)
        status = self._functions[q.dtype](
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            None if ranges is None else ranges.data_ptr(), int(causal),
            batch, n, k.shape[1], heads, k.shape[2], dim, scale, torch.get_num_threads())
        return out, status

    def __call__(self, q, k, v, ranges, scale, causal=False):
        out, status = self._run(q, k, v, ranges, scale, causal)
        self.calls += 1
        if status:
            raise RuntimeError(f"span attention kernel refused q {list(q.shape)} {q.dtype}, "
                               f"k {list(k.shape)} (status {status})")
        return out


def load(cache_dir: Path) -> SpanAttentionKernel | None:
    """The kernel (built into ``cache_dir`` if missing), or None where it
    cannot be built or this CPU lacks AVX-512 (logged): attention stays
    torch's. Without AVX-512 BF16 or BW, or on a CPU with AMX where the build
    has no AMX tiles, only float32 runs by it."""
    kernel = build.load(SpanAttentionKernel, SOURCE, cache_dir, "attention stays torch's")
    if kernel is not None and torch.bfloat16 not in kernel.runs:
        logger.info("vllm_accel: span attention kernel in float32 only (no AVX-512 BF16 or BW)")
    return kernel


def _kernel() -> SpanAttentionKernel | None:
    """The span kernel of the forward running now (None: torch's SDPA)."""
    return get_forward_context().kernels.span


def supported(q: torch.Tensor) -> bool:
    """Whether ``attend`` runs the kernel for queries like ``q``."""
    kernel, dim = _kernel(), q.shape[-1]
    return (kernel is not None and q.device.type == "cpu" and q.dtype in kernel.dtypes
            and dim <= MAX_HEAD_DIM and (dim % 2 == 0 or q.dtype == torch.float32))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           ranges: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """q [batch, tokens, heads, dim], k and v [batch, keys, kv_heads, dim]
    (heads a multiple of kv_heads: grouped query heads) -> like q, by our
    kernel where ``supported``, else by torch's SDPA (over each run of rows
    with one span separately: ``_by_segments``). Query r
    attends to keys ranges[.., r, 0] up to (not including) ranges[.., r, 1]
    (int32 [batch, tokens, 2], never empty), or without ranges to every key
    of its batch entry, or, causal, to keys 0..keys - tokens + r (the last
    ``tokens`` keys are the queries' own)."""
    return _op(q, k, v, ranges, scale, causal)


def span_mask(ranges: torch.Tensor, keys: int) -> torch.Tensor:
    """ranges [batch, rows, 2] -> [batch, 1, rows, keys] bool: whether a
    row attends to a key (SDPA's ``attn_mask``, broadcast over heads)."""
    index = torch.arange(keys, device=ranges.device)
    return ((index >= ranges[..., :1]) & (index < ranges[..., 1:]))[:, None]


def reference(q, k, v, scale, ranges=None, causal=False):
    """``attend`` by torch's SDPA: what the kernel must equal."""
    mask = None
    if causal:  # bottom-right aligned, as the kernel (SDPA's is_causal is top-left)
        rows, keys = q.shape[1], k.shape[1]
        ends = torch.arange(keys - rows + 1, keys + 1, device=q.device)
        ranges = torch.stack([torch.zeros_like(ends), ends], -1).expand(q.shape[0], -1, -1)
    if ranges is not None:
        mask = span_mask(ranges, k.shape[1])
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                         attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Heads and dim contiguous, as the kernel reads them (tokens may be spaced)."""
    dim = t.shape[-1]
    return t if t.stride(-1) == 1 and t.stride(-2) == dim else t.contiguous()


def _by_segments(q, k, v, ranges, scale):
    """``attend`` by torch's SDPA, one call per run of rows with the same span
    (an image, a window), runs of one shape batched: no work across spans, as
    one masked SDPA over the call would do (several times faster for
    Qwen2.5-VL's full blocks over packed images)."""
    out = q.new_empty(q.shape)  # contiguous, as the op's shape function says
    for entry, spans in enumerate(ranges):
        first = torch.ones(spans.shape[0], dtype=torch.bool)
        first[1:] = (spans[1:] != spans[:-1]).any(-1)
        starts = first.nonzero().flatten()
        ends = torch.cat([starts[1:], starts.new_tensor([spans.shape[0]])])
        # (rows, keys) -> the (first row, first key) of each run of that shape
        runs: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for start, end, (key_start, key_end) in zip(starts.tolist(), ends.tolist(),
                                                    spans[starts].tolist()):
            runs.setdefault((end - start, key_end - key_start), []).append((start, key_start))
        for (rows, keys), firsts in runs.items():
            attended = F.scaled_dot_product_attention(
                _stacked(q[entry], [row for row, _ in firsts], rows),
                _stacked(k[entry], [key for _, key in firsts], keys),
                _stacked(v[entry], [key for _, key in firsts], keys),
                scale=scale, enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
            for (start, _), rows_out in zip(firsts, attended):
                out[entry, start:start + rows] = rows_out
    return out


def _stacked(t: torch.Tensor, starts: list[int], length: int) -> torch.Tensor:
    """[tokens, heads, dim] -> [len(starts), heads, length, dim]: the runs
    of ``length`` tokens from ``starts``."""
    return torch.stack([t[start:start + length] for start in starts]).transpose(1, 2)


def _span_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    ranges: torch.Tensor | None, scale: float,
                    causal: bool = False) -> torch.Tensor:
    if not supported(q):  # torch's SDPA (bfloat16 with AMX, no AVX-512, ...)
        if ranges is not None and not causal:
            return _by_segments(q, k, v, ranges, scale)
        return reference(q, k, v, scale, ranges, causal).contiguous()
    q, k, v = (_rows_contiguous(t) for t in (q, k, v))
    if ranges is not None:
        ranges = ranges.to(torch.int32).contiguous()  # what the kernel reads
    return _kernel()(q, k, v, ranges, scale, causal)


def _span_attention_shape(q, k, v, ranges, scale, causal=False):
    return q.new_empty(q.shape)


_op = ops.define("span_attention(Tensor q, Tensor k, Tensor v, Tensor? ranges, float scale, "
                 "bool causal=False) -> Tensor", _span_attention, _span_attention_shape)


# FMS towers (LlavaNext's SigLIP) pick their attention by name at each call.
FMS_ATTN_NAME = "vllm_accel_bidirectional"
_fms_registered = False


def _fms_store(keys, values, key_cache, value_cache, **_):
    return keys, values, keys, values  # no cache: a tower attends within its call


def _fms_compute(query, keys, values, nheads, kvheads, p_dropout, scale_factor, **attn_kwargs):
    """FMS's layout: [batch, tokens, heads, dim] in and out. With ``ranges``
    (a tower's images packed in one call: Pixtral's) each row attends to
    its span of keys, on any device; with ``block_mask`` (bool) or
    ``position_bias`` (MPNet's, -inf outside each row's span), both
    [blocks, 1 or heads, tokens a block, tokens a block], one batch entry's
    tokens attend within blocks of that many, by torch's SDPA with the mask
    or with the bias added to the scores."""
    scale = scale_factor if scale_factor is not None else query.shape[-1] ** -0.5
    mask = attn_kwargs.get("position_bias", attn_kwargs.get("block_mask"))
    if mask is not None:
        blocks = mask.shape[0]
        out = F.scaled_dot_product_attention(
            *(t.reshape(blocks, -1, *t.shape[2:]).transpose(1, 2)
              for t in (query, keys, values)),
            attn_mask=mask, scale=scale, enable_gqa=nheads != kvheads)
        return out.transpose(1, 2).reshape(query.shape)
    ranges = attn_kwargs.get("ranges")
    if ranges is not None:
        return attend(query, keys, values, scale, ranges)
    if supported(query) and not p_dropout and "mask" not in attn_kwargs:
        return attend(query, keys, values, scale)
    return fms_attention._sdpa_compute_op(query, keys, values, nheads, kvheads, p_dropout,
                                          scale_factor, is_causal_mask=False, **attn_kwargs)


def register_fms_attention() -> str:
    """Register the FMS attention op (once per process; FMS refuses
    duplicates) and return its name, for a tower's ``attn_name``."""
    global _fms_registered
    if not _fms_registered:
        fms_attention.register_attention_op(FMS_ATTN_NAME, _fms_store, _fms_compute)
        _fms_registered = True
    return FMS_ATTN_NAME
