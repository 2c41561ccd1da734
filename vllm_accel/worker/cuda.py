"""The cuda device's start-up work for the runner: the memory profile that
sizes the KV cache, and capturing the CUDA graphs of its forwards
(cuda_graphs.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_accel.model.paged_attention import TableShape
from vllm_accel.worker.cuda_graphs import ForwardGraphs
from vllm_accel.worker.in_flight import NO_TOKENS_IN_FLIGHT
from vllm_accel.worker.kv_cache import allocate_kv_caches
from vllm_accel.worker.step_layout import StepLayout, pack_step

if TYPE_CHECKING:
    from vllm_accel.worker.model_runner import AccelModelRunner


def dummy_embeddings(runner: AccelModelRunner, bucket: int) -> torch.Tensor:
    """Zero embeddings of a forward of ``bucket`` tokens: a vision model
    always runs on embeddings, computed before the forward."""
    width = runner.vision.embedding_width(runner.model.hidden_size)
    return torch.zeros(1, bucket, width, dtype=runner.dtype, device=runner.device)


def prefill_filling(bucket: int, max_model_len: int, block_size: int,
                    table_shape: TableShape) -> tuple[StepLayout, int]:
    """One forward of prompts that fill ``bucket`` tokens, and the KV blocks
    it writes (block 0 included, never a request's). No prompt is longer than
    the model's context: a longer one would read rotary positions the model
    does not have (a token bucket may be larger than max_model_len)."""
    full, rest = divmod(bucket, max_model_len)
    lengths = np.array([max_model_len] * full + [rest] * (rest > 0))
    blocks = -(-lengths // block_size)
    first = np.cumsum(blocks) - blocks + 1  # each prompt in blocks of its own
    block_table = np.zeros((len(lengths), table_shape.width), dtype=np.int32)
    for row, (lo, count) in enumerate(zip(first, blocks)):
        block_table[row, :count] = np.arange(lo, lo + count)
    token_ids = np.zeros((len(lengths), max_model_len), dtype=np.int64)
    step = pack_step(token_ids, block_table, lengths, np.zeros_like(lengths), block_size,
                     lambda tokens: [bucket], lambda width: width, None, table_shape)
    return step, block_table, int(blocks.sum()) + 1


def _profile_caches(runner: AccelModelRunner, num_blocks: int) -> list[tuple]:
    """A KV cache of ``num_blocks`` blocks a layer for the profile; a layer
    that keeps recurrent state gets its pages as bytes (a state fits in an
    attention block's page: config_checks.configure_recurrent_state), all
    such layers in one recurrent group."""
    model = runner.model
    caches = allocate_kv_caches(model.num_layers, num_blocks, runner.block_size,
                                model.num_kv_heads, model.head_dim, runner.dtype, runner.device)
    group = torch.zeros(1, dtype=torch.int64, device=runner.device)
    for layer in model.recurrent:
        caches[layer] = (*(t.view(torch.uint8).view(num_blocks, -1) for t in caches[layer]),
                         group)
    return caches


def profile_peak_memory(runner: AccelModelRunner) -> int:
    """Bytes a prefill forward of the largest token bucket allocates beyond
    what is held before it (its activations), with a KV cache of just the
    blocks it needs; the memory is freed again."""
    bucket, bs, model, device = runner.token_buckets[-1], runner.block_size, runner.model, \
        runner.device
    step, block_table, num_blocks = prefill_filling(bucket, runner.max_model_len, bs,
                                                    runner.table_shape)
    kv_caches = _profile_caches(runner, num_blocks)
    forward = step.forwards[0]
    # Each prompt's state in its first block (models that keep one).
    recurrent = forward.recurrent_layout([block_table]) if model.recurrent else None
    staged = runner.forward_inputs[bucket]
    sent = staged.send(forward, NO_TOKENS_IN_FLIGHT)
    # A vision model runs on embeddings (computed before the forward).
    inputs = sent.input_ids if runner.vision is None else dummy_embeddings(runner, bucket)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    serving_caches, runner.kv_cache.layers = runner.kv_cache.layers, kv_caches
    try:
        with torch.inference_mode():
            runner.model_call(inputs, sent.positions, sent.metadata, sent.logit_rows,
                              recurrent=recurrent)
    finally:
        runner.kv_cache.layers = serving_caches
    peak = torch.cuda.max_memory_allocated(device) - before
    del kv_caches
    torch.cuda.empty_cache()
    return peak


@torch.inference_mode()
def capture_graphs(runner: AccelModelRunner) -> ForwardGraphs:
    """One graph per token bucket, after warmup compiled every bucket."""
    graphs = ForwardGraphs()
    for bucket in runner.token_buckets:
        staged = runner.forward_inputs[bucket]
        # A vision model runs on embeddings, computed before the graph.
        inputs = staged.input_ids if runner.vision is None \
            else dummy_embeddings(runner, bucket)
        graphs.capture(bucket, inputs, staged, runner.model_call)
    runner.compile_stats.after_step("capturing CUDA graphs")
    return graphs


