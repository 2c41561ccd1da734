"""torch.compile for stacks of identical layers.

Layers of one class share code and shapes, so one compiled function serves
them all, with the weights as graph inputs: one graph per input shape, and
compile time that does not grow with depth. Shapes are static (one graph per
bucket), as on a real accelerator.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn

from vllm_accel.patches import raise_recompile_limit


def _own_copy(function):
    """A copy of ``function`` with its own code object. Dynamo keeps compiled
    graphs per code object, process-wide; a copy makes each engine own (and
    count) its graphs instead of silently reusing another engine's."""
    copy = types.FunctionType(
        function.__code__.replace(), function.__globals__, function.__name__,
        function.__defaults__, function.__closure__,
    )
    copy.__kwdefaults__ = function.__kwdefaults__  # keyword-only defaults (FMS blocks have some)
    return copy


def compile_shared_forward(layers: list[nn.Module], backend: str, num_shapes: int) -> None:
    """Make every layer run one shared compiled copy of its class's forward."""
    compiled = torch.compile(
        _own_copy(type(layers[0]).forward), backend=backend, dynamic=False, fullgraph=True
    )
    # An instance attribute wins over the class's forward in nn.Module.__call__.
    for layer in layers:
        layer.forward = functools.partial(compiled, layer)
    raise_recompile_limit(num_shapes)
