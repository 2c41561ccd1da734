"""A forward's inputs on the GPU in one buffer, sent in one copy (cuda).

A forward reads token ids, rotary positions, KV cache slots, the sequence
table (query starts, context lengths, block tables), the rows whose logits
it computes and, under async scheduling, where the tokens still in flight go.
Sent as separate tensors that was eight host-to-device copies a one-forward
step, each a driver call from pageable memory, then six copies into the CUDA
graph's own tensors: host time the GPU waits for, every step (the engine is
bound by its host on a GPU). Here all of a token bucket's inputs live in one device
buffer, which the bucket's graph reads in place; each forward writes them
into pinned host memory and sends them with one non-blocking copy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from vllm_accel.compat import SplitKvScratch
from vllm_accel.model.mamba2 import RecurrentLayout
from vllm_accel.model.paged_attention import (AttentionLayouts, PagedAttentionMetadata,
                                               SequenceTable, layouts_to)
from vllm_accel.worker.step_layout import BucketedForward


@dataclass
class DeviceForward:
    """What one forward reads on the device."""

    input_ids: torch.Tensor  # [1, bucket]
    positions: torch.Tensor  # [1, bucket] or [3, 1, bucket]
    metadata: AttentionLayouts  # a layout per attention group
    logit_rows: torch.Tensor  # [rows]: the real ones first, then padding (row 0)
    num_logits: int  # how many of logit_rows are real
    # Tokens in flight (async scheduling): input_ids[0, targets[:n]] takes the
    # previous step's sampled tokens[sources[:n]].
    in_flight_targets: torch.Tensor
    in_flight_sources: torch.Tensor
    num_in_flight: int
    recurrent: RecurrentLayout | None = None  # models with recurrent layers


def device_forward(forward: BucketedForward, in_flight: tuple[np.ndarray, np.ndarray],
                   device: torch.device, recurrent: RecurrentLayout | None = None
                   ) -> DeviceForward:
    """``forward``'s inputs as tensors of their own on ``device`` (cpu: the
    same tensors): for devices whose layout is not a fixed-shape table."""
    def copy(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device, non_blocking=True)

    targets, sources = (torch.from_numpy(a) for a in in_flight)
    return DeviceForward(copy(forward.input_ids), copy(forward.positions),
                         layouts_to(forward.attention_layouts, device),
                         copy(forward.logit_rows),
                         len(forward.logit_rows), copy(targets), copy(sources), len(targets),
                         recurrent)


# Where each view starts in the buffer: at 16 bytes, the alignment inductor's
# kernels assume of an input that was aligned when they compiled (a view that
# is not is copied before every call of the graph that reads it: the rotary
# positions and the slots a layer's graph reads).
_ALIGN = 16


def _aligned(count: int, itemsize: int) -> int:
    """``count`` items rounded up to whole ``_ALIGN``-byte spans."""
    per_span = _ALIGN // itemsize
    return -(-count // per_span) * per_span


class _Layout:
    """Where each input sits in the buffer: int64 ones first, then int32 ones
    (slots and block table: one of each per attention group; recurrent
    states' blocks and flags: models with recurrent layers), each at a
    16-byte boundary."""

    def __init__(self, bucket: int, rows: int, width: int, position_axes: int, groups: int,
                 state_groups: int):
        self.shapes64 = {"input_ids": (1, bucket), "logit_rows": (rows,),
                         "in_flight_targets": (rows,), "in_flight_sources": (rows,),
                         "positions": (1, bucket) if position_axes == 1
                         else (position_axes, 1, bucket),
                         **{f"slots{g}": (bucket,) for g in range(groups)},
                         **({"state_blocks": (state_groups, rows), "has_state": (rows,)}
                            if state_groups else {})}
        self.shapes32 = {"query_start": (rows + 1,), "seq_lens": (rows,),
                         **{f"block_table{g}": (rows, width) for g in range(groups)}}
        self.size64 = sum(_aligned(int(np.prod(s)), 8) for s in self.shapes64.values())
        size32 = sum(_aligned(int(np.prod(s)), 4) for s in self.shapes32.values())
        self.words = self.size64 + size32 // 2  # int64 words in all

    def views(self, buffer):
        """Named views into an int64 buffer (torch tensor or numpy array)."""
        out, offset = {}, 0
        for name, shape in self.shapes64.items():
            size = int(np.prod(shape))
            out[name] = buffer[offset : offset + size].reshape(shape)
            offset += _aligned(size, 8)
        int32 = buffer[self.size64 :].view(np.int32 if isinstance(buffer, np.ndarray)
                                           else torch.int32)
        offset = 0
        for name, shape in self.shapes32.items():
            size = int(np.prod(shape))
            out[name] = int32[offset : offset + size].reshape(shape)
            offset += _aligned(size, 4)
        return out


class ForwardInputs:
    """The device inputs of every forward of one token bucket (rows: the
    bucket's sequence table rows, ``TableShape.rows``), a layout for each
    attention group (``windows``: each group's window, 0: none) and, for
    models with recurrent layers, each sequence's state block in each of the
    ``state_groups`` recurrent KV cache groups."""

    def __init__(self, bucket: int, rows: int, width: int, position_axes: int,
                 device: torch.device, windows: list[int] = (0,),
                 split_kv: SplitKvScratch | None = None, state_groups: int = 0):
        self.bucket, self.rows = bucket, rows
        self._layout = _Layout(bucket, rows, width, position_axes, len(windows), state_groups)
        self._buffer = torch.zeros(self._layout.words, dtype=torch.int64, device=device)
        views = self._layout.views(self._buffer)
        self.input_ids, self.positions = views["input_ids"], views["positions"]
        # The groups' sequences are the same (queries, context lengths); their
        # blocks, slots and windows their own.
        self.metadata = tuple(
            PagedAttentionMetadata(
                slot_mapping=views[f"slots{g}"], num_decodes=0,
                sequences=SequenceTable(views["query_start"], views["seq_lens"],
                                        views[f"block_table{g}"]),
                window=window, split_kv=split_kv)
            for g, window in enumerate(windows))
        self.logit_rows = views["logit_rows"]
        self._in_flight = views["in_flight_targets"], views["in_flight_sources"]
        self._states = (views["has_state"], views["state_blocks"]) if state_groups else None
        # Pinned host buffers and the event of each one's last copy: the host
        # fills a buffer only once the device has read it (a step is prepared
        # while the previous one runs, and a step may hold several forwards of
        # this bucket), so there are as many as copies in flight.
        self._on_gpu = self._buffer.is_cuda
        self._host: list[tuple[torch.Tensor, dict[str, np.ndarray], _CopyDone]] = []

    def clear(self) -> None:
        """An empty layout: padding tokens in the null block, no sequences."""
        self._buffer.zero_()

    def decode_graph_layout(self) -> RecurrentLayout | None:
        """What a CUDA graph of this bucket reads for its recurrent layers (a
        graph of decodes only), None for a model without them."""
        return (None if self._states is None
                else RecurrentLayout.for_decode_graph(self.rows, *self._states))

    def send(self, forward: BucketedForward, in_flight: tuple[np.ndarray, np.ndarray],
             recurrent: RecurrentLayout | None = None) -> DeviceForward:
        """Write ``forward``'s inputs (``in_flight``: packed indices in the
        forward and the previous step's rows of the tokens in flight;
        ``recurrent``: its segments' states, models with recurrent layers)
        and queue their copy to the device."""
        host, views, event = self._free_host_buffer()
        assert forward.bucket == self.bucket
        n = forward.end - forward.begin
        _put(views["input_ids"][0], forward.token_ids, n)
        _put(views["positions"].reshape(-1, self.bucket), forward.rotary, n)
        first, seq_lens, _ = forward.table_rows()
        rows = len(first)
        _put(views["query_start"], first, rows, fill=n)  # padding rows: no queries
        _put(views["seq_lens"], seq_lens, rows)
        for g in range(len(self.metadata)):
            _put(views[f"slots{g}"], forward.group_slots(g), n)  # padding writes into block 0
            views[f"block_table{g}"][:rows] = forward.table_rows(g)[2]
            views[f"block_table{g}"][rows:] = 0
        num_logits = len(forward.logit_index)
        _put(views["logit_rows"], forward.logit_index, num_logits)
        targets, sources = in_flight
        views["in_flight_targets"][: len(targets)] = targets
        views["in_flight_sources"][: len(sources)] = sources
        if recurrent is not None:  # padding rows: the null block
            segments = len(recurrent.starts)
            _put(views["has_state"], recurrent.has_state.numpy(), segments)
            _put(views["state_blocks"], recurrent.state_blocks.numpy(), segments)
            recurrent = replace(recurrent, sent=self._states)
        self._buffer.copy_(host, non_blocking=True)
        event.record()
        return DeviceForward(self.input_ids, self.positions, self.metadata, self.logit_rows,
                             num_logits, *self._in_flight, len(targets), recurrent)

    def _free_host_buffer(self):
        for entry in self._host:
            if entry[2].query():  # its last copy is done
                return entry
        host = torch.zeros(self._layout.words, dtype=torch.int64, pin_memory=self._on_gpu)
        entry = (host, self._layout.views(host.numpy()),
                 torch.cuda.Event() if self._on_gpu else _CopyDone())
        self._host.append(entry)
        return entry


def _put(view: np.ndarray, values: np.ndarray, count: int, fill: int = 0) -> None:
    """``view[..., :count]`` takes ``values``; the rest is padding (``fill``)."""
    view[..., :count] = values
    view[..., count:] = fill


class _CopyDone:
    """The event of a copy that was synchronous (a device in host memory)."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True
