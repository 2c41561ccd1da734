"""The paged KV cache's memory on the cpu: zero, writable, and in 4 KiB pages
(a first touch of a transparent huge page, while serving, can wait for the
kernel to compact memory)."""

from __future__ import annotations

from pathlib import Path

import torch

from vllm_accel.worker.kv_cache import allocate_kv_caches, kv_cache_bytes

def mapping_of(address: int) -> dict[str, str]:
    """This process's /proc/self/smaps entry for the mapping holding ``address``."""
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # "start-end perms ..." starts a mapping
            start, end = (int(part, 16) for part in head.split("-"))
            if entry is not None:
                return entry
            entry = {} if start <= address < end else None
        elif entry is not None:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
    assert entry is not None, f"no mapping holds {address:#x}"
    return entry


def test_cpu_kv_cache_is_zero_writable_and_not_in_huge_pages():
    # 8 MiB a tensor: large enough for huge pages (numpy's zeros would ask for them).
    caches = allocate_kv_caches(num_layers=2, num_blocks=1024, block_size=32, num_kv_heads=2,
                                head_dim=64, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert kv_cache_bytes(caches) == 2 * 2 * 1024 * 32 * 2 * 64 * 2
    key_cache = caches[0][0]
    assert key_cache.shape == (1024, 32, 2, 64) and key_cache.is_contiguous()
    assert not any(t.any() for cache in caches for t in cache)
    key_cache[5, 3] = 1.5
    assert key_cache.sum().item() == 1.5 * 2 * 64 and not caches[0][1].any()
    mapping = mapping_of(key_cache.data_ptr())
    assert "nh" in mapping["VmFlags"].split()  # MADV_NOHUGEPAGE
    assert mapping.get("AnonHugePages") == "0 kB"
