"""Pooling models (``--runner pooling``): vLLM's pooler over a step's hidden states.

The runner computes every scheduled token's hidden state and hands them, in
``InputBatch`` order, to vLLM's own ``DispatchPooler``, which reads the
model's pooler config (sentence-transformers' ``modules.json`` and
``1_Pooling``, ``--pooler-config``): CLS, mean or last-token pooling,
normalization, matryoshka dimensions, a classifier's head and activation.
A request's pooled output comes back when its prompt is done (a decoder
embedder may prefill in chunks; vLLM's pooling cursor says which are done).

Decoder embedders run the decoder's usual forwards over the paged KV
cache. Encoder-only models (``model/fms_encoder.py``) keep no KV cache: each
step's prompts are packed into blocks of whole prompts (``encoder_blocks``),
each padded to a token bucket (``pack_encoder_step``), each prompt attending
only to itself. On a GPU a forward holds 2, 4, ... such blocks side by side
(``encode_step``), attention computed within each block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.pooler import DispatchPooler
from vllm.pooling_params import PoolingParams
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.gpu_input_batch import InputBatch

from vllm_accel.buckets import fit_bucket, token_buckets
from vllm_accel.forward_context import ForwardContext, set_forward_context
from vllm_accel.settings import env_var_name

if TYPE_CHECKING:
    from vllm_accel.worker.model_runner import AccelModelRunner


class PoolingHead:
    """vLLM's pooler for this model: embedding tasks, or with ``classify``
    (a classifier's head on pooled states) classification tasks."""

    def __init__(self, vllm_config, classify: Callable[[torch.Tensor], torch.Tensor] | None):
        pooler_config = vllm_config.model_config.pooler_config
        with set_current_vllm_config(vllm_config):  # vLLM's poolers read it as they build
            self.pooler = (DispatchPooler.for_embedding(pooler_config) if classify is None
                           else DispatchPooler.for_seq_cls(pooler_config, classifier=classify))

    def supported_tasks(self) -> tuple[str, ...]:
        return tuple(sorted(self.pooler.get_supported_tasks()))

    def prepare(self, params: PoolingParams) -> None:
        """What the pooler needs of a new request's parameters (vLLM's rule)."""
        if params.task is None:
            raise ValueError("a pooling request reached the runner without a task")
        self.pooler.get_pooling_updates(params.task).apply(params)

    def pool(self, hidden: torch.Tensor, batch: InputBatch, num_scheduled: np.ndarray,
             context: ForwardContext) -> ModelRunnerOutput:
        """hidden [tokens, hidden]: the step's scheduled tokens in batch
        order -> each request's pooled output, None where its prompt is not
        done. A classifier's head may run by our kernel: under ``context``."""
        num_reqs = batch.num_reqs
        seq_lens = torch.from_numpy(
            batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64) + num_scheduled)
        metadata = batch.get_pooling_metadata()
        metadata.build_pooling_cursor(num_scheduled, seq_lens, device=hidden.device)
        with set_forward_context(context):
            pooled = self.pooler(hidden_states=hidden, pooling_metadata=metadata)
        done = metadata.get_pooling_cursor().get_finished_mask()
        # To the host in one copy where the outputs come as one tensor.
        pooled = (list(pooled.float().cpu()) if isinstance(pooled, torch.Tensor)
                  else [None if out is None else out.float().cpu() for out in pooled])
        return ModelRunnerOutput(
            req_ids=batch.req_ids.copy(), req_id_to_index=batch.req_id_to_index.copy(),
            pooler_output=[out if finished else None for out, finished in zip(pooled, done)])


def encoder_token_buckets(spec: str, max_step: int, max_model_len: int,
                          large_forwards: bool) -> list[int]:
    """An encoder's token buckets. A prompt runs whole in one forward, so
    the largest holds max_model_len. Where fewer, larger forwards win over
    padding less (``DeviceBackend.prefers_large_forwards``), doublings of
    that one up to a whole step: forwards of 2, 4, ... blocks of whole
    prompts, each block attending within itself (``encoder_block``)."""
    buckets = token_buckets(spec, max_step, max_model_len)
    if buckets[-1] < max_model_len:
        raise ValueError(
            f"{env_var_name('token_buckets')}={spec!r}: an encoder runs each prompt in one "
            f"forward, so the largest token bucket must be at least "
            f"max_model_len={max_model_len}; add one or lower max_model_len")
    if large_forwards and not spec:
        block = encoder_block(buckets, max_model_len, large_forwards)
        buckets = [b for b in buckets if b <= block]
        while buckets[-1] * 2 <= max_step:
            buckets.append(buckets[-1] * 2)
    return buckets


def encoder_block(buckets: list[int], max_model_len: int, large_forwards: bool) -> int:
    """Tokens in a block of whole prompts. Where large forwards win, the
    smallest bucket that holds the longest prompt (the larger buckets hold
    2, 4, ... blocks); on the cpu the largest bucket (a forward is one
    block: its padded rows would cost compute, and attention by spans does
    no work across prompts)."""
    if not large_forwards:
        return buckets[-1]
    return next(b for b in buckets if b >= max_model_len)


def batch_order(first_tokens: np.ndarray, counts: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The packed index of every token, requests taken in batch-row order
    (``rows``: the batch row of each packed request)."""
    by_row = np.argsort(rows)
    return np.concatenate([np.arange(first_tokens[i], first_tokens[i] + counts[i])
                           for i in by_row])


@dataclass
class EncoderStep:
    """A forward of an encoder-only model: its prompts packed in the order
    given, in one block padded to ``bucket`` tokens or in blocks of
    ``block`` tokens, each padded at its end. Each token's span [first,
    end) is its prompt's (a padding token's: itself); positions restart per
    prompt; token type 1 where the request's pair range says (a
    cross-encoder's second text)."""

    input_ids: torch.Tensor  # [1, bucket]
    positions: torch.Tensor  # [1, bucket]
    token_types: torch.Tensor  # [1, bucket]
    ranges: torch.Tensor  # [blocks, bucket / blocks, 2] int32, within each block
    live: np.ndarray  # where the prompts' tokens are, in order

    @classmethod
    def of_blocks(cls, blocks: list[EncoderStep]) -> EncoderStep:
        """One forward of ``blocks`` (each padded to the same size) side by side."""
        size = blocks[0].input_ids.shape[1]
        live = np.concatenate([b.live + i * size for i, b in enumerate(blocks)])
        return cls(*(torch.cat([getattr(b, name) for b in blocks], 1)
                     for name in ("input_ids", "positions", "token_types")),
                   torch.cat([b.ranges for b in blocks]), live)


def pack_encoder_step(token_ids: np.ndarray, num_scheduled: np.ndarray,
                      type_ranges: list[tuple[int, int] | None],
                      bucket_for: Callable[[int], int]) -> EncoderStep:
    """``token_ids`` [rows, max_len]: the batch's; each row's first
    ``num_scheduled`` tokens are its whole prompt."""
    total = int(num_scheduled.sum())
    bucket = bucket_for(total)
    ids = np.zeros(bucket, dtype=np.int64)
    positions = np.zeros(bucket, dtype=np.int64)
    types = np.zeros(bucket, dtype=np.int64)
    ranges = np.empty((bucket, 2), dtype=np.int32)
    padding = np.arange(total, bucket, dtype=np.int32)
    ranges[total:, 0], ranges[total:, 1] = padding, padding + 1  # each to itself: no work
    start = 0
    for row, count in enumerate(num_scheduled.tolist()):
        end = start + count
        ids[start:end] = token_ids[row, :count]
        positions[start:end] = np.arange(count)
        if type_ranges[row] is not None:
            first, last = type_ranges[row]
            types[start + min(first, count):start + min(last, count)] = 1
        ranges[start:end] = (start, end)
        start = end
    as_tensor = torch.from_numpy
    return EncoderStep(as_tensor(ids)[None], as_tensor(positions)[None],
                       as_tensor(types)[None], as_tensor(ranges)[None], np.arange(total))


def token_type_ranges(batch: InputBatch) -> list[tuple[int, int] | None]:
    """Each request's tokens of type 1 (vLLM's scoring front end sends a
    cross-encoder's pair as that range), None: all type 0."""
    ranges = []
    for params in batch.get_pooling_params():
        extra = params.extra_kwargs or {}
        ranges.append(extra.get("compressed_token_type_ids"))
    return ranges


def encoder_blocks(counts: np.ndarray, largest: int) -> list[np.ndarray]:
    """The step's requests (batch rows) cut into blocks of whole prompts,
    each at most ``largest`` tokens (a prompt attends to all of itself, so it
    is never cut): first fit, longest first, which pads far less than
    cutting in batch order."""
    blocks: list[list[int]] = []
    room: list[int] = []
    for row in np.argsort(-counts, kind="stable").tolist():
        count = int(counts[row])
        fits = next((i for i, free in enumerate(room) if count <= free), None)
        if fits is None:
            blocks.append([row])
            room.append(largest - count)
        else:
            blocks[fits].append(row)
            room[fits] -= count
    return [np.array(rows) for rows in blocks]


def blocks_per_forward(blocks: int, sizes: list[int]) -> list[int]:
    """``blocks`` blocks cut into forwards of ``sizes`` blocks (those a
    token bucket holds exactly; 1 among them), the largest that fits first."""
    cut = []
    while blocks:
        size = max(s for s in sizes if s <= blocks)
        cut.append(size)
        blocks -= size
    return cut


def encode_step(runner: AccelModelRunner, num_scheduled: np.ndarray) -> torch.Tensor:
    """An encoder-only model's step: its prompts' hidden states [tokens, hidden]
    in batch order. Prompts are packed into blocks of whole prompts, blocks
    into forwards (one block padded to a bucket, or 2, 4, ... blocks of
    ``encoder_block`` tokens: the larger buckets)."""
    batch = runner.input_batch
    type_ranges = token_type_ranges(batch)
    block = encoder_block(runner.token_buckets, runner.max_model_len,
                          runner.backend.prefers_large_forwards)
    blocks = encoder_blocks(num_scheduled, block)
    hidden, first = [], 0

    def pack(rows: np.ndarray, bucket_for) -> EncoderStep:
        return pack_encoder_step(batch.token_ids_cpu[rows], num_scheduled[rows],
                                 [type_ranges[row] for row in rows], bucket_for)

    sizes = [b // block for b in runner.token_buckets if b >= block and b % block == 0]
    for size in blocks_per_forward(len(blocks), sizes):
        group, first = blocks[first:first + size], first + size
        if size == 1:
            step = pack(group[0], lambda n: fit_bucket(runner.token_buckets, n, "tokens",
                                                       env_var_name("token_buckets")))
        else:
            step = EncoderStep.of_blocks([pack(rows, lambda n: block) for rows in group])
        inputs = [t.to(runner.device, non_blocking=True) for t in
                  (step.input_ids, step.positions, step.token_types, step.ranges)]
        bucket, tokens = inputs[0].shape[1], len(step.live)
        # Padding rows last (one block), or between blocks: nothing to skip.
        live_rows = tokens if size == 1 else bucket
        with set_forward_context(runner.forward_context().padded(bucket, live_rows)):
            out = runner.encoder(*inputs)[0]
        hidden.append(out[:tokens] if size == 1
                      else out[torch.from_numpy(step.live).to(runner.device)])
        runner.compile_stats.after_step(f"a forward of {bucket} tokens")
    rows = np.concatenate(blocks)
    if len(rows) == 1 or (rows[1:] > rows[:-1]).all():
        return torch.cat(hidden)  # already in batch order
    counts = num_scheduled[rows]
    order = batch_order(np.cumsum(counts) - counts, counts, rows)
    return torch.cat(hidden)[torch.from_numpy(order).to(runner.device)]
