"""CUDA graphs of whole forwards: the static-shape design's payoff on a GPU.

A forward launches hundreds of small kernels (per layer: the compiled layer's
Triton kernels, the attention op's cache write and kernel); at small batches
the GPU waits on the host launching them. Each token bucket's forward is
captured once at warmup as one ``torch.cuda.CUDAGraph`` and replayed: the
graph reads the bucket's inputs and attention layout where each forward
sends them (``ForwardInputs``: one buffer, one copy), and the whole forward,
the LM head of the rows to sample included, is one launch.

What makes every forward capturable is the bucket design itself: tokens are
padded to the bucket, and the attention layout is a ``SequenceTable`` of a
fixed shape per bucket (``TableShape``: a row per sequence the forward can
hold, the widest context bucket's blocks), so one graph per token bucket
serves every step of that size, decodes and prefill chunks alike.

A model with recurrent layers is the exception: its Mamba2 layers run each
prefill chunk apart, led by the host, so its graphs hold forwards of decodes
only (model/mamba2.py) and a forward with a prefill chunk runs uncaptured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_accel.model.mamba2 import RecurrentLayout
from vllm_accel.model.paged_attention import AttentionLayouts
from vllm_accel.worker.forward_inputs import ForwardInputs

# (inputs, positions, layouts, logit_rows, recurrent=layout) -> (hidden
# states, logits or None): the runner's model call.
ModelCall = Callable[[torch.Tensor, torch.Tensor, AttentionLayouts, torch.Tensor],
                     tuple[torch.Tensor, torch.Tensor | None]]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [1, bucket] ids or [1, bucket, hidden] embeddings
    outputs: tuple[torch.Tensor, torch.Tensor | None]  # the captured hidden states, logits
    decodes_only: bool  # captured with recurrent layers: serves forwards of decodes only


class ForwardGraphs:
    def __init__(self) -> None:
        self.graphs: dict[int, _Graph] = {}
        self.pool = None  # one memory pool shared by all graphs (they never run at once)
        self.replays = 0

    def capture(self, bucket: int, inputs: torch.Tensor, staged: ForwardInputs,
                model_call: ModelCall) -> None:
        """Capture the forward of ``bucket`` tokens reading ``inputs`` (the
        staged token ids, or a buffer of embeddings) and the rest of
        ``staged``; its values do not matter (cleared: an empty layout)."""
        staged.clear()
        recurrent = staged.decode_graph_layout()

        def call():
            return model_call(inputs, staged.positions, staged.metadata, staged.logit_rows,
                              recurrent=recurrent)

        call()  # once outside: lazy state, allocator warm
        torch.cuda.synchronize(inputs.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = call()
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[bucket] = _Graph(graph, inputs, outputs, recurrent is not None)

    def serves(self, bucket: int, recurrent: RecurrentLayout | None) -> bool:
        """Whether a graph runs a forward of ``bucket`` tokens whose recurrent
        layers (if any) have the segments ``recurrent``."""
        g = self.graphs.get(bucket)
        return g is not None and (not g.decodes_only or recurrent.decodes_only)

    def replay(self, bucket: int, inputs: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward's hidden states [1, bucket, hidden] and logits [rows,
        vocab] (the graph's own output tensors: read them before the next
        replay). The layout is the bucket's ``ForwardInputs``, as sent."""
        g = self.graphs[bucket]
        if inputs.data_ptr() != g.inputs.data_ptr():  # embeddings: computed outside
            g.inputs.copy_(inputs)
        g.graph.replay()
        self.replays += 1
        return g.outputs
