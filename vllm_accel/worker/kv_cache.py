"""The paged KV cache's memory: one (keys, values) pair of tensors per layer,
each ``[num_blocks, block_size, num_kv_heads, head_dim]``, the layout the
attention op reads (vLLM's KV cache manager hands out the block ids)."""

from __future__ import annotations

import ctypes
import sys

import numpy as np
import torch

from vllm_accel.compat import any_size_along

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype, device: torch.device) -> KVCaches:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [(zero_filled(shape, dtype, device), zero_filled(shape, dtype, device))
              for _ in range(num_layers)]
    for cache in caches:
        # The block count follows the memory free at start-up: were it part of
        # the compiled graphs' shapes, another count would miss the compile
        # cache (the graphs only hand the caches to the attention op).
        for tensor in cache:
            any_size_along(tensor, 0)
    return caches


def kv_cache_bytes(kv_caches: KVCaches) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv_caches)


def zero_blocks(kv_caches: KVCaches, block_ids: list[int]) -> None:
    """Zero blocks freshly allocated from vLLM's pool, as its scheduler asks,
    so that no stale (NaN) data from an earlier request reaches attention."""
    if not kv_caches:
        return
    # On the cache's device once, without waiting for its work (cpu ids
    # would be copied, and waited for, per layer).
    ids = torch.tensor(block_ids).to(kv_caches[0][0].device, non_blocking=True)
    for key_cache, value_cache in kv_caches:
        key_cache[ids] = 0
        value_cache[ids] = 0


def zero_filled(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor. On the CPU from calloc'd memory, mapped in at once
    (``populate``): the OS zero-fills it faster than torch.zeros writes it."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    memory = np.zeros(nbytes + _HUGE_PAGE, dtype=np.uint8)
    offset = -memory.ctypes.data % _HUGE_PAGE  # where huge pages can start
    populate(memory.ctypes.data + offset, nbytes)
    return torch.from_numpy(memory[offset : offset + nbytes]).view(dtype).view(shape)


_HUGE_PAGE = 2 * 2**20
_MADV_HUGEPAGE, _MADV_POPULATE_WRITE = 14, 23  # Linux
_libc = None


def populate(address: int, nbytes: int) -> None:
    """Map in the pages of [address, address + nbytes) now, huge pages where
    the OS allows. Left to first touch, every new KV block would page-fault
    while serving: vLLM hands out free blocks oldest first, so a run touches
    the whole cache before reusing any (measured: benchmarks/README.md).
    Without Linux 5.14's MADV_POPULATE_WRITE the pages stay on first touch."""
    global _libc
    if not sys.platform.startswith("linux"):
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _libc.madvise(address, nbytes, _MADV_HUGEPAGE)  # a hint: refused is fine
    _libc.madvise(address, nbytes, _MADV_POPULATE_WRITE)
