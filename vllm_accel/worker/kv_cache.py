"""The paged KV cache's memory: one (keys, values) pair of tensors per layer,
each ``[num_blocks, block_size, num_kv_heads, head_dim]``, the layout the
attention op reads (vLLM's KV cache manager hands out the block ids)."""

from __future__ import annotations

import mmap

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
    """A zero-filled tensor. On the CPU from a private anonymous mapping, which
    the OS zero-fills page by page on first touch, so a large cache costs
    nothing at start-up (torch.zeros writes every byte first), in 4 KiB pages:
    vLLM hands out the blocks it has never used first, so a fresh cache is
    touched while serving, and a first touch of a transparent huge page
    (numpy's zeros asks for them) took up to 2 ms on these VMs, the kernel
    compacting memory for it: 1.17 s a GiB against 0.17 s in 4 KiB pages."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    memory = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    array = np.frombuffer(memory, dtype=np.uint8, count=nbytes)
    return torch.from_numpy(array).view(dtype).view(shape)
