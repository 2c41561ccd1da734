"""Our ops in torch's registry (namespace ``vllm_accel``): compiled graphs
call them as opaque kernels, with a fake implementation for their shapes.

Defined by schema, not by ``torch.library.custom_op``: a custom_op call goes
through Python layers for autograd, in-place views and an aliasing check on
each call: under inference mode (how the runner runs) one costs more than an
op defined here, about three times as much where it writes the KV caches; a
decode step calls five a layer.

A compiled graph calls each op by name with the arguments of its schema, and
inductor's cache does not key its graphs on our schemas: a graph cached by a
version whose op took other arguments would be loaded and fail at its first
call (seen: "blocked_linear() expected at most 4 argument(s) but received
6"), or pass an argument where another is now. ``fingerprint`` names the
schemas, for the cache's folder.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import torch

NAMESPACE = "vllm_accel"
_library: torch.library.Library | None = None
_schemas: list[str] = []


def define(schema: str, implementation: Callable, fake: Callable) -> torch._ops.OpOverload:
    """Define ``vllm_accel::<schema>`` (every device runs ``implementation``;
    compilers trace ``fake``) and return the op to call."""
    global _library
    if _library is None:
        _library = torch.library.Library(NAMESPACE, "FRAGMENT")
    name = schema.split("(", 1)[0]
    _library.define(schema)
    _schemas.append(schema)
    _library.impl(name, implementation, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_library)
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def fingerprint() -> str:
    """A short hash of the schemas of every op defined so far."""
    return hashlib.sha256("\n".join(sorted(_schemas)).encode()).hexdigest()[:12]
