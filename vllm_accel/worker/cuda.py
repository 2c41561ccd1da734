"""The cuda device's start-up work for the runner: the memory profile that
sizes the KV cache, and capturing the CUDA graphs of its forwards
(cuda_graphs.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm.utils.math_utils import cdiv

from vllm_accel.model.paged_attention import PagedAttentionMetadata, SequenceTable
from vllm_accel.patches import inductor_cache_dir
from vllm_accel.worker.cuda_graphs import ForwardGraphs
from vllm_accel.worker.kv_cache import allocate_kv_caches

if TYPE_CHECKING:
    from vllm_accel.worker.model_runner import AccelModelRunner


def dummy_inputs(runner: AccelModelRunner, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero inputs and positions of a forward of ``bucket`` tokens, as the
    runner feeds its model (embeddings for a vision model, 3-D positions for
    M-RoPE)."""
    device, vision = runner.device, runner.vision
    positions = torch.arange(bucket, device=device)[None]
    if vision is not None and vision.uses_3d_positions:
        positions = positions[None].expand(3, 1, bucket).contiguous()
    if vision is not None:  # a vision model always runs on embeddings
        inputs = torch.zeros(1, bucket, runner.model.hidden_size, dtype=runner.dtype,
                             device=device)
    else:
        inputs = torch.zeros(1, bucket, dtype=torch.int64, device=device)
    return inputs, positions


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


def profile_peak_memory(runner: AccelModelRunner) -> int:
    """Bytes a prefill forward of the largest token bucket allocates beyond
    what is held before it (its activations), with a KV cache of just the
    blocks it needs; the memory is freed again."""
    bucket, bs, model, device = runner.token_buckets[-1], runner.block_size, runner.model, \
        runner.device
    blocks = cdiv(bucket, bs) + 1  # block 0 is never a request's
    kv_caches = allocate_kv_caches(model.num_layers, blocks, bs, model.num_kv_heads,
                                   model.head_dim, runner.dtype, device)
    # One prompt of the whole bucket, in blocks 1, 2, ...
    shape = runner.table_shape
    metadata = empty_layout(bucket, shape.rows(bucket), max(shape.width, blocks - 1), device)
    metadata.slot_mapping += torch.arange(bs, bs + bucket, device=device)
    table = metadata.sequences
    table.query_start[1:] = bucket
    table.seq_lens[0] = bucket
    table.block_table[0, : blocks - 1] = torch.arange(1, blocks, device=device)
    inputs, positions = dummy_inputs(runner, bucket)
    logit_rows = torch.zeros(shape.rows(bucket), dtype=torch.int64, device=device)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    serving_caches, runner.kv_caches = runner.kv_caches, kv_caches
    try:
        with torch.inference_mode(), inductor_cache_dir(runner.compile_stats.cache_dir):
            runner.model_call(inputs, positions, metadata, logit_rows)
    finally:
        runner.kv_caches = serving_caches
    peak = torch.cuda.max_memory_allocated(device) - before
    del kv_caches
    torch.cuda.empty_cache()
    return peak


@torch.inference_mode()
def capture_graphs(runner: AccelModelRunner) -> ForwardGraphs:
    """One graph per token bucket, after warmup compiled every bucket."""
    graphs = ForwardGraphs()
    with inductor_cache_dir(runner.compile_stats.cache_dir):
        for bucket in runner.token_buckets:
            staged = runner.forward_inputs[bucket]
            # A vision model runs on embeddings, computed before the graph.
            inputs = staged.input_ids if runner.vision is None \
                else dummy_inputs(runner, bucket)[0]
            graphs.capture(bucket, inputs, staged, runner.model_call)
    runner.compile_stats.after_step("capturing CUDA graphs")
    return graphs


