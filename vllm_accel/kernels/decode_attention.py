"""The CPU decode-attention kernel (decode_attention.cpp): each decode row's
query over its KV blocks read in place, and the step's KV writes.

Built by build.py into the compile cache. If it cannot be built, attention
stays on the PyTorch path (a warning gives the compiler's message).
"""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import torch
from vllm_accel.log import get_logger
from vllm_accel.kernels import build as kernel_build

logger = get_logger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.cpp")

_I64, _F32, _INT, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p


# The kernel's entry point for each cache dtype it reads.
_ENTRY_POINTS = {torch.float32: "decode_attention_f32", torch.bfloat16: "decode_attention_bf16",
                 torch.float16: "decode_attention_f16"}


class DecodeAttentionKernel:
    """The kernel's entry points, loaded from a built shared library."""

    def __init__(self, library: Path):
        loaded = ctypes.CDLL(str(library))
        self._functions = {dtype: getattr(loaded, name) for dtype, name in _ENTRY_POINTS.items()}
        for function in self._functions.values():
            function.restype = _I64  # -1, or the first row whose context overflows its table
            function.argtypes = [_PTR] * 6 + [_I64] * 6 + [_F32, _INT]
        self.calls = 0  # one per layer of each forward with decodes (tests count them)
        self._store = loaded.store_kv
        self._store.restype = _I64
        self._store.argtypes = [_PTR] * 2 + [_I64] * 2 + [_PTR] * 3 + [_I64] * 3

    @staticmethod
    def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
        return (key_cache.device.type == "cpu" and key_cache.dtype == query.dtype
                and query.dtype in _ENTRY_POINTS)

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_table: torch.Tensor, context_lens: torch.Tensor,
                 scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """query [rows, heads, dim], one token per row attending over the first
        context_lens[row] tokens of its blocks -> [rows, heads, dim] (into
        ``out`` where given: contiguous, query's shape and dtype). A context
        longer than its block-table row: IndexError, nothing computed."""
        rows, heads, dim = query.shape
        block_size, kv_heads = key_cache.shape[1:3]
        query = query.contiguous()
        block_table = block_table.contiguous()
        context_lens = context_lens.contiguous()
        out = torch.empty_like(query) if out is None else out
        assert key_cache.is_contiguous() and value_cache.is_contiguous() and out.is_contiguous()
        self.calls += 1
        bad = self._functions[query.dtype](
            query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            block_table.data_ptr(), context_lens.data_ptr(), out.data_ptr(),
            rows, heads, kv_heads, dim, block_size, block_table.shape[1],
            scale, torch.get_num_threads(),
        )
        if bad >= 0:
            raise IndexError(f"decode row {bad}: context of {int(context_lens[bad])} tokens, "
                             f"its block table holds {block_table.shape[1] * block_size}")
        return out

    def store(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
              value_cache: torch.Tensor, slots: torch.Tensor) -> bool:
        """Write key/value [tokens, kv_heads, dim] into their cache slots (int64
        [tokens]), as index_copy_ would (a slot outside the cache: IndexError,
        nothing written); False (nothing written) where the tensors are not
        laid out as the kernel reads them."""
        rows_contiguous = all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]
                              for t in (key, value))
        if not (rows_contiguous and key.dtype == key_cache.dtype == value.dtype
                and key_cache.is_contiguous() and value_cache.is_contiguous()
                and slots.dtype == torch.int64 and slots.is_contiguous()
                and key.shape[1:] == key_cache.shape[2:] == value.shape[1:]
                and key.shape[0] == value.shape[0] == slots.shape[0]):
            return False
        size, cache_slots = key.element_size(), key_cache.shape[0] * key_cache.shape[1]
        bad = self._store(key.data_ptr(), value.data_ptr(), key.stride(0) * size,
                          value.stride(0) * size, key_cache.data_ptr(), value_cache.data_ptr(),
                          slots.data_ptr(), slots.shape[0], key.shape[1] * key.shape[2] * size,
                          cache_slots)
        if bad >= 0:
            raise IndexError(f"KV cache slot {int(slots[bad])} (token {bad}) out of range "
                             f"[0, {cache_slots})")
        return True


def build(cache_dir: Path) -> Path:
    """The kernel's shared library under ``cache_dir``, built if missing."""
    return kernel_build.build(SOURCE, cache_dir)


def load(cache_dir: Path) -> DecodeAttentionKernel | None:
    """The kernel, or None (with a warning giving the compiler's message) when
    it cannot be built here. It runs on every CPU (a scalar path without
    AVX-512)."""
    try:
        return DecodeAttentionKernel(build(cache_dir))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = (getattr(error, "stderr", "") or str(error)).strip()
        logger.warning("vllm_accel: the decode attention kernel could not be built, decode "
                       "attention stays on the PyTorch path (slower): %s", detail)
        return None

