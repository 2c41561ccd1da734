"""torch.compile for stacks of identical layers.

Layers of one class share code and shapes, so one compiled function serves
them all, with the weights as graph inputs: one graph per input shape, and
compile time that does not grow with depth. Shapes are static (one graph per
bucket), as on a static-shape accelerator; or, with a ``BucketAxis`` (cpu, cuda),
one graph serves every bucket above 1: its kernels read the size at run time,
and calls are still padded to buckets.

A call through torch.compile first checks dynamo's guards, for an FMS layer a
tree of a few hundred checks over its submodules, a few percent of a small
model's batch. So each layer runs the
graph dynamo chose for a kind of call (its arguments' shapes, strides and
dtypes; other arguments' values) directly from the second such call on.

With a ``SavedGraphs`` store (the cpu backend), a kind of call's graph and
the code dynamo wrote to call it come from a file instead (saved_graphs.py):
a warm start traces nothing.

Warmup only needs each kind of call to reach a graph once: while the
forward's context says ``warming_up``, the other layers of the stack find
their graph by dynamo's guards without running it and pass their input on (a
full-size vision tower ran every layer of every bucket at each start, most of
a warm start).
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from vllm_accel.compat import any_size_along, dynamo_code_for
from vllm_accel.forward_context import get_forward_context
from vllm_accel.model.saved_graphs import PLAIN_TYPES, SavedGraphs, compile_ahead_of_time
from vllm_accel.patches import raise_recompile_limit, shared_graph_compile


def _with_code(function, code: types.CodeType):
    """``function`` running ``code`` instead of its own."""
    copy = types.FunctionType(code, function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__  # keyword-only defaults (FMS blocks have some)
    return copy


def _own_copy(function):
    """A copy of ``function`` with its own code object. Dynamo keeps compiled
    graphs per code object, process-wide; a copy makes each engine own (and
    count) its graphs instead of silently reusing another engine's."""
    return _with_code(function, function.__code__.replace())


@dataclass(frozen=True)
class BucketAxis:
    """Where a layer's arguments carry the size that buckets pad (tokens in a
    decoder, tiles or crops in a vision tower), so that one graph serves
    every size from 2 to ``largest``. A size of 1 keeps a graph of its own
    (dynamo specializes sizes 0 and 1)."""

    dims: tuple[tuple[str, int], ...]  # (argument name, its dimension of that size)
    largest: int

    def mark(self, arguments: dict) -> bool:
        """Mark the axis in a call's ``arguments`` (parameter name -> value;
        a keyword argument gathered by ``**kwargs`` is found by its own name);
        whether the call takes the shared graph."""
        gathered = [v for v in arguments.values() if isinstance(v, dict)]
        marked = False
        for name, dim in self.dims:
            tensor = arguments.get(name)
            if tensor is None:
                tensor = next((d[name] for d in gathered if name in d), None)
            if isinstance(tensor, torch.Tensor) and 1 < tensor.shape[dim] <= self.largest:
                any_size_along(tensor, dim % tensor.dim(), (2, self.largest))
                marked = True
        return marked


def compile_shared_forward(layers: list[nn.Module], backend: str, num_shapes: int,
                           saved: SavedGraphs | None = None,
                           bucket_axis: BucketAxis | None = None) -> None:
    """Make every layer run one shared compiled copy of its class's forward;
    with ``saved``, each graph is loaded from there, or compiled and saved;
    with ``bucket_axis``, a graph serves any size above 1 along it."""
    function = _own_copy(type(layers[0]).forward)
    compiled = torch.compile(function, backend=backend, dynamic=False, fullgraph=True)
    stack = LayerStack(saved, compile_ahead_of_time(function, backend) if saved else None,
                       bucket_axis)
    # An instance attribute wins over the class's forward in nn.Module.__call__.
    for layer in layers:
        layer.forward = LayerForward(layer, function, compiled, stack)
    raise_recompile_limit(num_shapes)


class LayerStack:
    """What the layers sharing one compiled function share: for each kind of
    call one of them ran, whether its output had its first input's shape and
    dtype (a residual layer's), where graphs are saved (None: in dynamo's own
    cache only) and their bucket axis, if shared."""

    def __init__(self, saved: SavedGraphs | None = None,
                 ahead_of_time: Callable | None = None,
                 bucket_axis: BucketAxis | None = None):
        self.passes_input_shape: dict[tuple, bool] = {}
        self.saved = saved
        self.ahead_of_time = ahead_of_time  # the compiled function that saved graphs use
        self.bucket_axis = bucket_axis


class LayerForward:
    """One layer's forward through the shared compiled function.

    The first call of a kind goes through dynamo (its guards pick a graph, or
    it compiles one); later calls of that kind run the code dynamo ran then:
    the same graph, without the guards. What a kind leaves out is what does
    not change while an engine serves: the layer's own attributes and weights'
    shapes, and global state other than grad and inference mode.

    While the forward's context says ``warming_up``, a layer whose kind of call
    another layer of its stack has run, with an output shaped as its input,
    takes the graph dynamo picks for it (as its first call would) and returns
    its input without computing: each kind of call then has its graph in every
    layer afterwards."""

    def __init__(self, layer: nn.Module, function: Callable, compiled: Callable,
                 stack: LayerStack):
        self._layer = layer
        self._function = function
        self._compiled = compiled
        self.stack = stack
        self._direct: dict[tuple, Callable] = {}
        # Calls that went through dynamo (with saved graphs: the first run of
        # each kind, which loaded or compiled its graph); tests count them.
        self.guarded_calls = 0

    def __call__(self, *args, **kwargs):
        if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
            # The hidden states, laid out row by row: the graph's output takes
            # its input's layout, so one strided input (SigLIP's patches come
            # transposed from its convolution) would make every layer's
            # normalizations read across rows and copy before each matmul.
            args = (args[0].contiguous(), *args[1:])
        kind = _call_kind(args, kwargs)
        direct = self._direct.get(kind)
        arguments = None  # the call bound to the function's parameters, once, if needed
        shared = False  # whether the call takes the graph of every size above 1
        if direct is None and self.stack.bucket_axis is not None:
            # Before dynamo sees this kind: a graph that any size passes.
            arguments = self._arguments(args, kwargs)
            shared = self.stack.bucket_axis.mark(arguments)
        if direct is None and kind is not None and self.stack.saved is not None:
            # This layer's first call of the kind: the graph and the code that
            # calls it come saved (or are compiled and saved), no dynamo.
            # A shared graph is saved apart from a bucket's own (the key holds the axis).
            saved_kind = kind if self.stack.bucket_axis is None else (*kind, self.stack.bucket_axis)
            direct = self.stack.saved.code_for(
                self._function, self.stack.ahead_of_time, self._layer, saved_kind, args, kwargs)
            if direct is not None:
                return self._first_saved_call(kind, direct, args, kwargs)
        if get_forward_context().warming_up and self.stack.passes_input_shape.get(kind):
            if direct is None:
                direct = self._code_dynamo_ran(arguments or self._arguments(args, kwargs))
            if direct is not None:
                self._direct[kind] = direct
                return args[0]
        if direct is not None:
            return direct(self._layer, *args, **kwargs)
        self.guarded_calls += 1
        with shared_graph_compile() if shared else contextlib.nullcontext():
            outputs = self._compiled(self._layer, *args, **kwargs)
        if kind is not None:
            self.stack.passes_input_shape[kind] = bool(args) and _same_shape(outputs, args[0])
            direct = self._code_dynamo_ran(arguments or self._arguments(args, kwargs))
            if direct is not None:
                self._direct[kind] = direct
        return outputs

    def _first_saved_call(self, kind, direct, args, kwargs):
        self._direct[kind] = direct
        if get_forward_context().warming_up and self.stack.passes_input_shape.get(kind):
            return args[0]  # as in __call__: another layer of the stack ran this kind
        self.guarded_calls += 1  # as dynamo's first call would be
        outputs = direct(self._layer, *args, **kwargs)
        self.stack.passes_input_shape.setdefault(
            kind, bool(args) and _same_shape(outputs, args[0]))
        return outputs

    def _arguments(self, args, kwargs) -> dict:
        """This layer's call as the function's parameters: name -> value."""
        bound = inspect.signature(self._function).bind(self._layer, *args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    def _code_dynamo_ran(self, arguments: dict) -> Callable | None:
        code = dynamo_code_for(self._function, arguments)
        return None if code is None else _with_code(self._function, code)


def _same_shape(output, first_input) -> bool:
    return (isinstance(output, torch.Tensor) and isinstance(first_input, torch.Tensor)
            and output.shape == first_input.shape
            and output.dtype == first_input.dtype and output.device == first_input.device)


class _Unknown(Exception):
    """An argument whose kind of call cannot be told from a key."""


def _call_kind(args: tuple, kwargs: dict) -> tuple | None:
    """What dynamo's guards could tell apart between two calls of one layer:
    grad mode, each tensor argument's metadata, other arguments' types and
    values. None where an argument is of another type (always guarded)."""
    try:
        return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                tuple(_describe(value) for value in args),
                tuple((name, _describe(value)) for name, value in kwargs.items()))
    except _Unknown:
        return None


def _describe(value):
    if isinstance(value, torch.Tensor):
        return (value.shape, value.stride(), value.dtype, value.device, value.requires_grad,
                value.is_inference())
    if isinstance(value, (tuple, list)):
        return (type(value), *(_describe(item) for item in value))
    if isinstance(value, PLAIN_TYPES):
        return (type(value), value)  # True == 1, but a guard tells them apart
    raise _Unknown
