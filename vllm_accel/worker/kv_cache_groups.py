"""The KV cache as the runner sees it: vLLM's KV cache groups, each layer's
tensors in them, and the attention layouts a forward carries.

vLLM's hybrid KV cache manager keeps layers of different kinds in KV cache
groups of their own: full attention, each sliding window (a window's group
frees the blocks behind it) and layers that keep recurrent state (Mamba2: one
block per request). Each group has its own block table. A forward carries
one attention layout per (attention group, window); where there are several,
each attention layer's KV cache entry names its layout's index.
"""

from __future__ import annotations

import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheSpec,
                                        MambaSpec, SlidingWindowSpec)

from vllm_accel.worker.kv_cache import (allocate_kv_caches, allocate_shared_caches,
                                        kv_cache_bytes, recurrent_state_specs, zero_blocks)


class KvCacheGroups:
    @classmethod
    def for_context(cls, layer_windows: list[int], recurrent: dict,
                    max_model_len: int) -> KvCacheGroups:
        """The groups of a model served up to ``max_model_len`` tokens: a
        window no sequence can outrun is none (0)."""
        return cls([w if w < max_model_len else 0 for w in layer_windows], recurrent)

    def __init__(self, layer_windows: list[int], recurrent: dict):
        # Each layer's window (a query sees its last ``window`` keys; 0: all)
        # and the layers that keep recurrent state (index -> mixer).
        self.layer_windows = layer_windows
        self.recurrent = recurrent
        # Per layer: its keys and values (and its layout's index where there
        # are several layouts), or (a recurrent layer) its state's pages and
        # the index of its group among ``state_groups``.
        self.layers: list[tuple[torch.Tensor, ...]] = []
        # Where groups share tensors: each shared tensor's two halves of pages.
        self.pages: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.attention_groups = [0] if layer_windows else []  # none: an encoder's
        self.state_groups: list[int] = []
        # Until the KV cache's config: one layout (a memory profile's forward).
        attention_windows = [w for i, w in enumerate(layer_windows) if i not in recurrent]
        self.layouts: list[tuple[int, int]] = [(0, attention_windows[0] if attention_windows
                                                else 0)] if layer_windows else []

    def attention_layers(self) -> list[int]:
        return [i for i in range(len(self.layer_windows)) if i not in self.recurrent]

    def specs(self, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
              max_model_len: int) -> dict[str, KVCacheSpec]:
        """vLLM's spec of each layer: full attention, a sliding window (vLLM's
        KV manager frees the blocks a window has left behind) or recurrent
        state (a block per request, its page as large as an attention
        layer's)."""
        shape = dict(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_dim,
                     dtype=dtype)
        specs: dict[str, KVCacheSpec] = {
            f"layers.{i}": SlidingWindowSpec(sliding_window=self.layer_windows[i], **shape)
            if self.layer_windows[i] else FullAttentionSpec(**shape)
            for i in self.attention_layers()}
        page = FullAttentionSpec(**shape).page_size_bytes
        specs.update(recurrent_state_specs(self.recurrent, page, max_model_len))
        return specs

    @staticmethod
    def bytes_per_token(specs: dict[str, KVCacheSpec], block_size: int,
                        max_model_len: int) -> int:
        """What a token of a full-length sequence costs: its keys and values,
        and its share of the recurrent states (one per sequence)."""
        states = sum(s.page_size_bytes for s in specs.values() if isinstance(s, MambaSpec))
        return (sum(s.page_size_bytes for s in specs.values() if not isinstance(s, MambaSpec))
                // block_size + cdiv(states, max_model_len))

    def allocate(self, config: KVCacheConfig, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 max_blocks_per_req: int) -> tuple[list[int], list[int]] | None:
        """The memory of vLLM's KV cache config, and each layer's layout.
        Returns each group's block size and blocks per request where there
        are several groups (the runner's InputBatch then needs a block table
        per group), None where there is one."""
        self.num_blocks = config.num_blocks
        num_layers = len(self.layer_windows)
        tables = None
        if len(config.kv_cache_groups) > 1:
            shared = allocate_shared_caches(config, num_layers, num_kv_heads, head_dim, dtype,
                                            device)
            self.layers, self.pages = shared.caches, shared.pages
            self.attention_groups, self.state_groups = shared.attention_groups, shared.state_groups
            tables = shared.block_tables(max_blocks_per_req)
        else:
            self.layers = allocate_kv_caches(num_layers, self.num_blocks, block_size,
                                             num_kv_heads, head_dim, dtype, device)
        self._assign_layouts(config)
        return tables

    def _assign_layouts(self, config: KVCacheConfig) -> None:
        """One layout per (KV cache group, window) of the attention layers.
        With vLLM's hybrid KV cache manager turned off
        (--disable-hybrid-kv-cache-manager) layers of several windows share
        one group, whose blocks stay, and still attend by their own windows.
        Where there are several layouts, each attention layer's entry names
        its layout's index (an int64 tensor on the host: a graph input, so
        every layer runs one graph)."""
        group_of = {int(name.split(".")[1]): g for g, group in enumerate(config.kv_cache_groups)
                    for name in group.layer_names}
        layout_of = {i: (group_of[i], self.layer_windows[i]) for i in self.attention_layers()}
        for i, (group, window) in layout_of.items():
            spec = config.kv_cache_groups[group].kv_cache_spec
            if isinstance(spec, SlidingWindowSpec) and spec.sliding_window != window:
                raise ValueError(f"vllm-accel: layer {i} attends with a window of {window} "
                                 f"tokens, its KV cache group with {spec.sliding_window}")
        self.layouts = sorted(set(layout_of.values()))
        if len(self.layouts) > 1:
            for i, layout in layout_of.items():
                index = torch.tensor([self.layouts.index(layout)])
                self.layers[i] = (*self.layers[i][:2], index)

    def nbytes(self) -> int:
        return kv_cache_bytes(self.pages or self.layers)

    def zero(self, block_ids: list[int]) -> None:
        zero_blocks(self.pages or self.layers, block_ids)
