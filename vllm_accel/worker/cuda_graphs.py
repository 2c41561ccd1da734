"""CUDA graphs of decode-only forwards: the static-shape design's payoff on a GPU.

A decode step's forward launches hundreds of small kernels (per layer: the
compiled layer's Triton kernels, the attention op's gather and SDPA); at small
batches the GPU waits on the host launching them. Each token bucket's
decode-only forward is captured once at warmup as one ``torch.cuda.CUDAGraph``
and replayed: the step's inputs and attention layout are copied into the
graph's static tensors, then the whole forward is one launch.

What makes a forward capturable is the bucket design itself: every tensor has
the bucket's shape. Decode rows are padded up to the bucket (padding rows
attend one slot of block 0, vLLM's null block, and their outputs are dropped),
and block tables up to the widest context bucket, so one graph per token
bucket serves every decode batch of that size. Steps with prefill chunks (a
Python list of chunks of any length) run without a graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_accel.model.paged_attention import PagedAttentionMetadata, attention_context

# (inputs, positions, metadata) -> hidden states: the runner's model call.
ModelCall = Callable[[torch.Tensor, torch.Tensor, PagedAttentionMetadata], torch.Tensor]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [1, bucket] ids or [1, bucket, hidden] embeddings
    positions: torch.Tensor  # [1, bucket] or [3, 1, bucket]
    metadata: PagedAttentionMetadata  # num_decodes == bucket
    hidden: torch.Tensor  # the captured output


class DecodeGraphs:
    def __init__(self, width: int):
        self.width = width  # block-table width of every graph (the widest context bucket)
        self.graphs: dict[int, _Graph] = {}
        self.pool = None  # one memory pool shared by all graphs (they never run at once)
        self.replays = 0

    def capture(self, bucket: int, inputs: torch.Tensor, positions: torch.Tensor,
                model_call: ModelCall) -> None:
        """Capture the decode-only forward of ``bucket`` rows. ``inputs`` and
        ``positions`` give the dtypes and shapes (their values do not matter)."""
        device = inputs.device
        metadata = PagedAttentionMetadata(
            slot_mapping=torch.zeros(bucket, dtype=torch.int64, device=device),
            num_decodes=bucket,
            decode_block_table=torch.zeros(bucket, self.width, dtype=torch.int64, device=device),
            decode_context_lens=torch.ones(bucket, dtype=torch.int64, device=device),
        )
        inputs, positions = inputs.clone(), positions.clone()
        model_call(inputs, positions, metadata)  # once outside: lazy state, allocator warm
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = model_call(inputs, positions, metadata)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[bucket] = _Graph(graph, inputs, positions, metadata, hidden)

    def can_replay(self, bucket: int, metadata: PagedAttentionMetadata, rows: int) -> bool:
        """A forward of ``rows`` decode tokens and nothing else, in a captured bucket."""
        return (bucket in self.graphs and not metadata.prefills and metadata.num_decodes == rows
                and metadata.decode_block_table.shape[1] <= self.width)

    def replay(self, bucket: int, inputs: torch.Tensor, positions: torch.Tensor,
               metadata: PagedAttentionMetadata) -> torch.Tensor:
        """The forward's hidden states [1, bucket, hidden] (the graph's own
        output tensor: read it before the next replay)."""
        g = self.graphs[bucket]
        rows, width = metadata.decode_block_table.shape
        g.inputs.copy_(inputs)
        g.positions.copy_(positions)
        static = g.metadata
        static.slot_mapping.copy_(metadata.slot_mapping)  # padding rows: slot 0 (block 0)
        static.decode_block_table.zero_()
        static.decode_block_table[:rows, :width].copy_(metadata.decode_block_table)
        static.decode_context_lens.fill_(1)
        static.decode_context_lens[:rows].copy_(metadata.decode_context_lens)
        g.graph.replay()
        self.replays += 1
        return g.hidden


def run_with_metadata(model, kv_caches, decode_kernel=None) -> ModelCall:
    """The model call the graphs capture: one forward under a given layout."""
    def call(inputs, positions, metadata):
        with attention_context(metadata, decode_kernel):
            return model(inputs, positions, kv_caches)

    return call
