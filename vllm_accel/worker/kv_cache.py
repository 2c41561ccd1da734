"""The paged KV cache's memory: one (keys, values) pair of tensors per layer,
each ``[num_blocks, block_size, num_kv_heads, head_dim]``, the layout the
attention op reads (vLLM's KV cache manager hands out the block ids). A
model with several KV cache groups (layers that keep recurrent state, Mamba2,
or attention layers of several kinds, windowed and full) takes vLLM's hybrid
layout instead: tensors of block pages shared by a layer of each KV cache
group (``allocate_shared_caches``)."""

from __future__ import annotations

import mmap
from dataclasses import dataclass

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
    return sum(t.numel() * t.element_size() for cache in kv_caches for t in cache[:2])


def zero_blocks(kv_caches: KVCaches, block_ids: list[int]) -> None:
    """Zero blocks freshly allocated from vLLM's pool, as its scheduler asks,
    so that no stale (NaN) data from an earlier request reaches attention."""
    if not kv_caches:
        return
    # On the cache's device once, without waiting for its work (cpu ids
    # would be copied, and waited for, per layer).
    ids = torch.tensor(block_ids).to(kv_caches[0][0].device, non_blocking=True)
    for cache in kv_caches:  # (keys, values[, layout index]) or a shared tensor's halves
        for tensor in cache[:2]:
            tensor[ids] = 0


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


# ---- hybrid models: several KV cache groups ---------------------------------

def recurrent_state_specs(mixers: dict, page_bytes: int, max_model_len: int) -> dict:
    """vLLM's ``MambaSpec`` of each recurrent layer (``layers.{i}`` ->
    spec): one block per request (``block_size`` max_model_len: vLLM's
    ``mamba_cache_mode`` "none"), its page padded to ``page_bytes`` (an
    attention layer's), as vLLM's hybrid KV cache manager needs."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    specs = {}
    for index, mixer in mixers.items():
        shapes = mixer.state_shapes()
        if shapes.nbytes > page_bytes:
            raise ValueError(
                f"A recurrent state of layer {index} takes {shapes.nbytes} bytes, more than "
                f"an attention block's page ({page_bytes}): the platform sizes the block "
                f"(--block-size) to hold it.")
        specs[f"layers.{index}"] = MambaSpec(
            shapes=(shapes.conv_shape, shapes.ssm_shape),
            dtypes=(shapes.conv_dtype, shapes.ssm_dtype), block_size=max_model_len,
            page_size_padded=page_bytes, mamba_type=MambaAttentionBackendEnum.MAMBA2,
            mamba_cache_mode="none")
    return specs


@dataclass
class SharedCaches:
    """A hybrid model's KV cache: per layer its keys and values (attention)
    or its state's pages and group (recurrent);
    every shared tensor as its two halves of block pages; which KV cache
    groups hold attention layers and which recurrent state, and each group's
    block size."""

    caches: list[tuple[torch.Tensor, ...]]
    pages: list[tuple[torch.Tensor, torch.Tensor]]
    attention_groups: list[int]
    state_groups: list[int]
    block_sizes: list[int]

    def block_tables(self, attention_blocks: int) -> tuple[list[int], list[int]]:
        """Each group's block size and blocks per request (InputBatch's)."""
        return self.block_sizes, [1 if g in self.state_groups else attention_blocks
                                  for g in range(len(self.block_sizes))]


def allocate_shared_caches(config, num_layers: int, num_kv_heads: int, head_dim: int,
                           dtype: torch.dtype, device: torch.device) -> SharedCaches:
    """The memory of vLLM's ``KVCacheConfig`` for a model of several KV cache
    groups: layers that keep recurrent state beside attention's keys and
    values, or attention layers of several kinds (full attention beside
    sliding windows: a group per kind, each with its own block table). vLLM's
    hybrid manager overlays its KV cache groups layer by layer (a block id
    belongs to one group at a time): the i-th layer of every group shares a
    region of ``num_blocks`` pages. Each region is two zero-filled tensors of
    half a page per block: an attention layer's keys ``[blocks, block_size,
    kv_heads, head_dim]`` and its values, the layout the attention op reads;
    a recurrent layer's state for block b is row b of both (model/mamba2.py).
    Two tensors, not one: no graph takes two inputs that share memory (with
    a block count left dynamic, inductor's handling of such inputs lost
    writes, seen with torch 2.13)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = config.kv_cache_groups
    is_state = [isinstance(g.kv_cache_spec, MambaSpec) for g in groups]
    attention = [g for g, state in enumerate(is_state) if not state]
    state_groups = [g for g, state in enumerate(is_state) if state]
    group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
    num_blocks = config.num_blocks
    caches: list[tuple[torch.Tensor, ...] | None] = [None] * num_layers
    regions: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for tensor in config.kv_cache_tensors:
        page = tensor.block_stride
        if tensor.layer_stride < num_blocks * page or page % 2:
            raise ValueError("vllm-accel lays a hybrid KV cache out layer by layer "
                             f"(layer stride {tensor.layer_stride}, block stride {page})")
        for i, name in enumerate(tensor.layers):
            start = tensor.offset + i * tensor.layer_stride
            if start not in regions:
                regions[start] = tuple(zero_filled((num_blocks, page // 2), torch.uint8, device)
                                       for _ in range(2))
            first, second = regions[start]
            layer, group = int(name.split(".")[1]), group_of[name]
            if is_state[group]:
                caches[layer] = (first, second,
                                 torch.tensor([state_groups.index(group)], device=device))
            else:
                caches[layer] = tuple(half.view(dtype).view(num_blocks, -1, num_kv_heads,
                                                            head_dim)
                                      for half in (first, second))
    for cache in caches:
        for tensor in cache[:2]:
            any_size_along(tensor, 0)  # as allocate_kv_caches: any block count, one graph
    return SharedCaches(caches, list(regions.values()), attention, state_groups,
                        [g.kv_cache_spec.block_size for g in groups])
