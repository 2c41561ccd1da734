"""CUDA graphs of whole forwards: the static-shape design's payoff on a GPU.

A forward launches hundreds of small kernels (per layer: the compiled layer's
Triton kernels, the attention op's cache write and kernel); at small batches
the GPU waits on the host launching them. Each token bucket's forward is
captured once at warmup as one ``torch.cuda.CUDAGraph`` and replayed: the
step's inputs and attention layout are copied into the graph's static
tensors, then the whole forward is one launch.

What makes every forward capturable is the bucket design itself: tokens are
padded to the bucket, and the attention layout is a ``SequenceTable`` of a
fixed shape per bucket (``TableShape``: a row per sequence the forward can
hold, the widest context bucket's blocks), so one graph per token bucket
serves every step of that size, decodes and prefill chunks alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_accel.model.paged_attention import (
    PagedAttentionMetadata,
    SequenceTable,
    TableShape,
    attention_context,
)

# (inputs, positions, metadata) -> hidden states: the runner's model call.
ModelCall = Callable[[torch.Tensor, torch.Tensor, PagedAttentionMetadata], torch.Tensor]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [1, bucket] ids or [1, bucket, hidden] embeddings
    positions: torch.Tensor  # [1, bucket] or [3, 1, bucket]
    metadata: PagedAttentionMetadata  # a SequenceTable of the bucket's shape
    hidden: torch.Tensor  # the captured output


def empty_layout(tokens: int, rows: int, width: int,
                 device: torch.device) -> PagedAttentionMetadata:
    """A forward of ``tokens`` padding tokens: every table row empty."""
    return PagedAttentionMetadata(
        slot_mapping=torch.zeros(tokens, dtype=torch.int64, device=device),
        num_decodes=0,
        sequences=SequenceTable(
            query_start=torch.zeros(rows + 1, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(rows, dtype=torch.int32, device=device),
            block_table=torch.zeros(rows, width, dtype=torch.int32, device=device),
        ),
    )


class ForwardGraphs:
    def __init__(self, table_shape: TableShape):
        self.table_shape = table_shape
        self.graphs: dict[int, _Graph] = {}
        self.pool = None  # one memory pool shared by all graphs (they never run at once)
        self.replays = 0

    def capture(self, bucket: int, inputs: torch.Tensor, positions: torch.Tensor,
                model_call: ModelCall) -> None:
        """Capture the forward of ``bucket`` tokens. ``inputs`` and
        ``positions`` give the dtypes and shapes (their values do not matter)."""
        shape = self.table_shape
        metadata = empty_layout(bucket, shape.rows(bucket), shape.width, inputs.device)
        inputs, positions = inputs.clone(), positions.clone()
        model_call(inputs, positions, metadata)  # once outside: lazy state, allocator warm
        torch.cuda.synchronize(inputs.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = model_call(inputs, positions, metadata)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[bucket] = _Graph(graph, inputs, positions, metadata, hidden)

    def can_replay(self, bucket: int, metadata: PagedAttentionMetadata) -> bool:
        table = metadata.sequences
        return bucket in self.graphs and table is not None \
            and table.block_table.shape == (self.table_shape.rows(bucket), self.table_shape.width)

    def replay(self, bucket: int, inputs: torch.Tensor, positions: torch.Tensor,
               metadata: PagedAttentionMetadata) -> torch.Tensor:
        """The forward's hidden states [1, bucket, hidden] (the graph's own
        output tensor: read it before the next replay)."""
        g = self.graphs[bucket]
        g.inputs.copy_(inputs)
        g.positions.copy_(positions)
        static, table = g.metadata, metadata.sequences
        static.slot_mapping.copy_(metadata.slot_mapping)
        static.sequences.query_start.copy_(table.query_start)
        static.sequences.seq_lens.copy_(table.seq_lens)
        static.sequences.block_table.copy_(table.block_table)
        g.graph.replay()
        self.replays += 1
        return g.hidden


def run_with_metadata(model, kv_caches, decode_kernel=None) -> ModelCall:
    """The model call the graphs capture: one forward under a given layout."""
    def call(inputs, positions, metadata):
        with attention_context(metadata, decode_kernel):
            return model(inputs, positions, kv_caches)

    return call
