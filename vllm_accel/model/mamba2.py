"""Mamba2 mixers over vLLM's paged recurrent state.

A Mamba2 layer keeps, per request, a state that sums up everything before it:
the last ``conv_kernel - 1`` inputs of its causal convolution (``conv``,
``[conv_dim, conv_kernel - 1]``) and the SSM state (``ssm``,
``[heads, head_dim, state_size]``). vLLM's hybrid KV cache manager gives each
request one block of the layer's KV cache group for it (``MambaSpec``); the
runner's layout says which block each request of a forward reads and writes.

The step's tokens come packed in one sequence (decodes first, one token each,
then prefill chunks), padded to a token bucket, as for attention. The linear
layers and the gated norm run in the compiled layer graph; the state-dependent
part (convolution and scan) is one opaque op, ``mamba2_mixer``, which reads the
forward's ``RecurrentLayout`` from the forward context:

- the decodes in one batch: one recurrence step each from its state;
- each prefill chunk apart: its convolution continues from its request's
  convolution inputs, and a chunked scan (Mamba2's SSD algorithm, as HF
  transformers' reference ``mamba2_chunk_scan``) from its SSM state, zero for
  a chunk that starts its prompt (a new request, or one vLLM preempted and
  computes again from scratch);
- each segment's final state written back to its block; padding rows are in
  no segment, so they read and write nothing (their outputs are zeros).

The segments are known on the host, so a forward with prefill chunks is not
capturable. A forward of decodes only is: a CUDA graph of a token bucket
captures ``RecurrentLayout.for_decode_graph``, a decode per sequence-table
row, each row's block and flag read from the forward's inputs on the device;
rows beyond the forward's decodes are padding on the null block 0.

Memory: vLLM's hybrid KV cache manager overlays attention and Mamba layers
(a block id belongs to one KV cache group at a time), each block a page of
the same size, kept as two tensors of half a page per block
(worker/kv_cache.py: an attention layer's keys and values). A recurrent
layer's state for block ``b`` is row ``b`` of the first followed by row
``b`` of the second, the SSM state first, then the convolution's inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from vllm_accel.forward_context import get_forward_context
from vllm_accel.kernels import ops
from vllm_accel.model.ssd_scan import chunked_scan


@dataclass
class RecurrentLayout:
    """Where each request's tokens are in one forward, and its state's block.

    Segments are in packed order: the first ``num_decodes`` are one token
    each, at rows 0 .. num_decodes - 1; the others are prefill chunks (rows
    ``starts[i]`` to ``ends[i]``). ``state_blocks[g, i]``: the block of
    segment i's state in the g-th recurrent KV cache group;
    ``has_state[i]``: whether segment i goes on from a state (False: its
    request starts here, from zeros). ``sent``: the same two on the device
    (has_state as integers), where the forward's inputs carried them."""

    num_decodes: int
    starts: list[int]
    ends: list[int]
    has_state: torch.Tensor  # [segments] bool, on the host
    state_blocks: torch.Tensor  # [groups, segments] int64, on the host
    sent: tuple[torch.Tensor, torch.Tensor] | None = None
    _copies: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def for_decode_graph(cls, rows: int, has_state: torch.Tensor,
                         state_blocks: torch.Tensor) -> RecurrentLayout:
        """The layout a CUDA graph of decodes is captured with: ``rows``
        one-token segments (a forward's decodes, then padding rows on the
        null block 0), whose flags and blocks the graph reads from
        ``has_state`` and ``state_blocks`` on the device, as each forward
        sends them. Its host flags say any segment may start here, so the
        capture records the clearing of new requests' states too; its host
        blocks are never read (zeros)."""
        return cls(rows, list(range(rows)), list(range(1, rows + 1)),
                   torch.zeros(rows, dtype=torch.bool),
                   torch.zeros(state_blocks.shape, dtype=torch.int64), (has_state, state_blocks))

    @property
    def tokens(self) -> int:
        return self.ends[-1] if self.ends else 0

    @property
    def decodes_only(self) -> bool:
        return self.num_decodes == len(self.starts)

    def continues(self, first: int, end: int) -> bool:
        """Whether every segment in [first, end) goes on from a state."""
        return bool(self.has_state[first:end].all())

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(has_state, state_blocks) on ``device``: as sent, or copied once
        a forward, not once a layer."""
        if self.sent is not None:
            return self.sent[0].bool(), self.sent[1]
        if device not in self._copies:
            self._copies[device] = (self.has_state.to(device), self.state_blocks.to(device))
        return self._copies[device]


@dataclass(frozen=True)
class StateShapes:
    """A Mamba2 layer's state per request: the SSM state and the
    convolution's last inputs, and their dtypes."""

    heads: int
    head_dim: int
    state_size: int
    conv_dim: int
    conv_kernel: int
    ssm_dtype: torch.dtype
    conv_dtype: torch.dtype

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        return (self.heads, self.head_dim, self.state_size)

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def ssm_bytes(self) -> int:
        return math.prod(self.ssm_shape) * self.ssm_dtype.itemsize

    @property
    def conv_bytes(self) -> int:
        return math.prod(self.conv_shape) * self.conv_dtype.itemsize

    @property
    def conv_offset(self) -> int:
        """Where the convolution's inputs start in a state's bytes (after the
        SSM state, 8-byte aligned: every part views as its dtype in place)."""
        return _aligned(self.ssm_bytes)

    @property
    def nbytes(self) -> int:
        """A state's bytes in its block (the page holds at least these)."""
        return _aligned(self.conv_offset + self.conv_bytes)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def _words(rows: torch.Tensor) -> torch.Tensor:
    """Byte rows viewed as 8-byte words where their width, row stride and
    offset allow (else as they are): torch's index_select and index_copy_
    move bytes element by element, ~7x slower than words
    (benchmarks/README.md, the hybrid shape)."""
    if rows.shape[-1] % 8 or rows.stride(0) % 8 or rows.storage_offset() % 8:
        return rows
    return rows.view(torch.int64)


class _States:
    """Some blocks' states read into one buffer, ``ssm`` [n, heads,
    head_dim, state] and ``conv`` [n, conv_dim, kernel - 1] views of it,
    changed in place and written back by ``write``."""

    def __init__(self, first: torch.Tensor, second: torch.Tensor, blocks: torch.Tensor,
                 shapes: StateShapes):
        self.first, self.second, self.blocks = first, second, blocks
        half, total = first.shape[1], shapes.nbytes
        raw = torch.empty(blocks.shape[0], total, dtype=torch.uint8, device=first.device)
        self._gather(first[:, :min(total, half)], raw[:, :half])
        if total > half:
            self._gather(second[:, :total - half], raw[:, half:])
        self.raw = raw
        n, start = blocks.shape[0], shapes.conv_offset
        self.ssm = raw[:, :shapes.ssm_bytes].view(shapes.ssm_dtype).view(n, *shapes.ssm_shape)
        self.conv = raw[:, start:start + shapes.conv_bytes].view(shapes.conv_dtype).view(
            n, *shapes.conv_shape)

    def clear(self, keep: torch.Tensor, continues: bool) -> None:
        """Zero the states of the rows not in ``keep`` (requests that start
        here); ``continues``, known on the host: whether all rows are (no
        sync)."""
        if not continues:
            self.ssm.masked_fill_(~keep[:, None, None, None], 0)
            self.conv.masked_fill_(~keep[:, None, None], 0)

    def write(self) -> None:
        half, total = self.first.shape[1], self.raw.shape[1]
        self._copy(self.first[:, :min(total, half)], self.raw[:, :half])
        if total > half:
            self._copy(self.second[:, :total - half], self.raw[:, half:])

    def _gather(self, pages: torch.Tensor, rows: torch.Tensor) -> None:
        """``rows`` = the blocks' rows of ``pages``, straight into the buffer."""
        pages, rows = _same_width(pages, rows)
        torch.index_select(pages, 0, self.blocks, out=rows)

    def _copy(self, pages: torch.Tensor, rows: torch.Tensor) -> None:
        pages, rows = _same_width(pages, rows)
        pages.index_copy_(0, self.blocks, rows)


def _same_width(pages: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both as words where both allow it, else both as bytes."""
    pages, rows = _words(pages), _words(rows)
    if pages.dtype != rows.dtype:
        return pages.view(torch.uint8), rows.view(torch.uint8)
    return pages, rows


# Devices where the decode step updates and reads out one request's state at
# a time (cache locality); elsewhere the whole batch at once.
ROW_BY_ROW_DEVICES = ("cpu",)


def _mamba2_mixer(xbc: torch.Tensor, dt: torch.Tensor, conv_weight: torch.Tensor,
                  conv_bias: torch.Tensor | None, dt_bias: torch.Tensor, A_log: torch.Tensor,
                  D: torch.Tensor, first: torch.Tensor, second: torch.Tensor,
                  group: torch.Tensor, groups: int, head_dim: int, state_size: int,
                  chunk: int, ssm_dtype: torch.dtype, conv_dtype: torch.dtype) -> torch.Tensor:
    """xbc [1, tokens, conv_dim] (the convolution's input: x, B and C), dt
    [1, tokens, heads] -> y [1, tokens, heads * head_dim] float32 (before the
    gated norm); reads and writes the states of the forward's segments."""
    layout = get_forward_context().recurrent
    assert layout is not None, "mamba2_mixer runs inside set_forward_context with a layout"
    heads = A_log.shape[0]
    conv_dim, kernel = conv_weight.shape
    shapes = StateShapes(heads, head_dim, state_size, conv_dim, kernel, ssm_dtype, conv_dtype)
    # The layout is built on the host; a GPU's pages need it on the GPU.
    has_state, blocks = layout.on(first.device)
    blocks = blocks.index_select(0, group)[0]  # ``group`` is on the device: no sync
    A = -torch.exp(A_log.float())
    out = torch.zeros(xbc.shape[1], heads * head_dim, dtype=torch.float32, device=xbc.device)
    width = conv_dim - 2 * groups * state_size  # x's part of xbc (heads * head_dim)

    def split(conv_out: torch.Tensor):  # [n, conv_dim] -> x [n, h, p], B, C [n, h, state]
        x, B, C = torch.split(conv_out.float(), [width, groups * state_size,
                                                 groups * state_size], dim=-1)
        repeat = heads // groups
        B, C = (t.reshape(-1, groups, state_size).repeat_interleave(repeat, dim=1)
                for t in (B, C))
        return x.reshape(-1, heads, head_dim), B, C

    def time_steps(rows: slice) -> torch.Tensor:
        return F.softplus(dt[0, rows].float() + dt_bias.float())  # [n, heads]

    n = layout.num_decodes
    if n:  # one recurrence step each, in one batch
        states = _States(first, second, blocks[:n], shapes)
        states.clear(has_state[:n], layout.continues(0, n))
        window = torch.cat([states.conv.to(xbc.dtype), xbc[0, :n, :, None]],
                           dim=-1)  # [n, conv_dim, kernel]
        conv_out = (window * conv_weight).sum(-1)
        if conv_bias is not None:
            conv_out = conv_out + conv_bias
        x, B, C = split(F.silu(conv_out))
        step = time_steps(slice(0, n))
        # state * exp(dt A) + (dt x) B, in place where the state is float32;
        # then y = state . C.
        ssm = states.ssm if ssm_dtype == torch.float32 else states.ssm.float()
        decay, step_x = torch.exp(step * A), step[..., None] * x
        if xbc.device.type in ROW_BY_ROW_DEVICES:
            # A request's state (heads x head_dim x state floats) is still in
            # cache when it is read out (a batched read-out after the batched
            # update ran ~2.5x slower on the cpu).
            y = torch.empty(n, heads, head_dim, dtype=torch.float32, device=xbc.device)
            for row in range(n):
                state = ssm[row].mul_(decay[row, :, None, None]).addcmul_(
                    step_x[row, :, :, None], B[row, :, None, :])
                torch.sum(state * C[row, :, None, :], dim=-1, out=y[row])
        else:  # a GPU: four launches, not four a request
            ssm.mul_(decay[..., None, None]).addcmul_(step_x[..., None], B[:, :, None, :])
            y = (ssm * C[:, :, None, :]).sum(-1)
        out[:n] = (y + D.float()[:, None] * x).reshape(n, -1)
        if ssm is not states.ssm:
            states.ssm.copy_(ssm)
        states.conv.copy_(window[..., 1:])
        states.write()

    for i in range(n, len(layout.starts)):  # each prefill chunk: a chunked scan
        rows = slice(layout.starts[i], layout.ends[i])
        states = _States(first, second, blocks[i:i + 1], shapes)
        states.clear(has_state[i:i + 1], layout.continues(i, i + 1))
        inputs = torch.cat([states.conv[0].to(xbc.dtype), xbc[0, rows].transpose(0, 1)],
                           dim=-1)
        conv_out = F.conv1d(inputs[None], conv_weight[:, None, :], conv_bias,
                            groups=conv_dim)[0].transpose(0, 1)  # [length, conv_dim]
        x, B, C = split(F.silu(conv_out))
        y, final = chunked_scan(x, time_steps(rows), A, B, C, chunk, states.ssm[0].float())
        y = y + D.float()[:, None] * x
        out[rows] = y.reshape(y.shape[0], -1)
        states.ssm[0].copy_(final)
        states.conv[0].copy_(inputs[:, 1 - kernel:])
        states.write()
    return out[None]


def _mamba2_mixer_shape(xbc, dt, conv_weight, conv_bias, dt_bias, A_log, D, first, second,
                        group, groups, head_dim, state_size, chunk, ssm_dtype, conv_dtype):
    return xbc.new_empty((1, xbc.shape[1], A_log.shape[0] * head_dim), dtype=torch.float32)


# The op writes the states of the forward's segments in place (a!, b!): a
# compiler orders every read of those pages after the write.
mamba2_mixer = ops.define(
    "mamba2_mixer(Tensor xbc, Tensor dt, Tensor conv_weight, Tensor? conv_bias, "
    "Tensor dt_bias, Tensor A_log, Tensor D, Tensor(a!) first, Tensor(b!) second, "
    "Tensor group, int groups, int head_dim, int state_size, int chunk, "
    "ScalarType ssm_dtype, ScalarType conv_dtype) -> Tensor",
    _mamba2_mixer, _mamba2_mixer_shape)


class PagedMamba2(nn.Module):
    """FMS's Mamba2 mixer (``fms.modules.ssm.SSM``: its weights and
    submodules) with its state in vLLM's paged KV cache: forward(x, state)
    with ``state`` = (first, second, group), the layer's pages
    (``state_page_views``) and the index of its KV cache group among the
    recurrent ones ([1] int64)."""

    def __init__(self, ssm: nn.Module):
        super().__init__()
        if ssm.activation not in ("silu", "swish"):
            raise ValueError(f"vllm-accel runs Mamba2 layers with a SiLU convolution "
                             f"activation, not {ssm.activation!r}")
        if tuple(ssm.time_step_limit) != (0.0, float("inf")):
            raise ValueError("vllm-accel runs Mamba2 layers without a time step limit")
        self.in_proj, self.conv1d, self.norm, self.out_proj = (
            ssm.in_proj, ssm.conv1d, ssm.norm, ssm.out_proj)
        self.dt_bias, self.A_log, self.D = ssm.dt_bias, ssm.A_log, ssm.D
        self.heads, self.head_dim = ssm.nheads, ssm.head_dim
        self.groups, self.state_size = ssm.n_groups, ssm.ssm_state_size
        self.intermediate_size, self.conv_dim = ssm.intermediate_size, ssm.conv_dim
        self.conv_kernel, self.chunk_size = ssm.conv_kernel_size, ssm.chunk_size
        # The state's dtypes (set by the runner from vLLM's cache config).
        self.ssm_dtype = self.conv_dtype = ssm.dt_bias.dtype

    def state_shapes(self) -> StateShapes:
        return StateShapes(self.heads, self.head_dim, self.state_size, self.conv_dim,
                           self.conv_kernel, self.ssm_dtype, self.conv_dtype)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """x [1, tokens, emb] -> [1, tokens, emb]."""
        gate, xbc, dt = self.in_proj(x).split(
            [self.intermediate_size, self.conv_dim, self.heads], dim=-1)
        first, second, group = state
        y = mamba2_mixer(
            xbc, dt, self.conv1d.weight[:, 0], self.conv1d.bias, self.dt_bias, self.A_log,
            self.D, first, second, group, self.groups, self.head_dim, self.state_size,
            self.chunk_size, self.ssm_dtype, self.conv_dtype)
        return self.out_proj(self.norm(y, gate).to(x.dtype))


class Mamba2Block(nn.Module):
    """A pre-norm decoder block around a ``PagedMamba2`` (Bamba's, Granite
    4's): norm, mixer, residual, norm, MLP, residual, each branch scaled by
    ``residual_multiplier`` (Granite's; 1 for Bamba). Called as FMS's
    headless models call their blocks; its ``past_key_value_state`` is the
    layer's paged state."""

    def __init__(self, ln: nn.Module, mixer: PagedMamba2, ff_ln: nn.Module,
                 ff_sub_layer: nn.Module, residual_multiplier: float = 1.0):
        super().__init__()
        self.ln, self.mixer, self.ff_ln, self.ff_sub_layer = ln, mixer, ff_ln, ff_sub_layer
        self.residual_multiplier = residual_multiplier

    def forward(self, x, *, position_ids=None, past_key_value_state=None, use_cache=False,
                **kwargs):
        x = x + self.mixer(self.ln(x), past_key_value_state) * self.residual_multiplier
        x = x + self.ff_sub_layer(self.ff_ln(x)) * self.residual_multiplier
        return (x, past_key_value_state) if use_cache else x


def recurrent_mixers(model: nn.Module) -> dict[int, PagedMamba2]:
    """Layer index -> its paged Mamba2 mixer, for the layers of ``model``'s
    decoder (``base_model.layers``) that keep recurrent state."""
    mixers = {}
    for index, layer in enumerate(model.base_model.layers):
        found = [m for m in layer.modules() if isinstance(m, PagedMamba2)]
        if found:
            mixers[index] = found[0]
    return mixers
