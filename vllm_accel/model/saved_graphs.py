"""Compiled layer graphs saved whole, so that a warm start skips dynamo.

A start with a warm inductor cache still traces every kind of layer call
with dynamo before inductor's cache hands back the graph, most of a warm
start. torch's ahead-of-time compile
(``aot_compile`` on a ``torch.compile``'d function) returns the graph
together with the code dynamo wrote to call it, and saves both in one file,
which loads in a fraction of the trace's time.

One file per kind of call (``compile._call_kind``) and kind of layer (its
classes, tensors' shapes and plain attributes, all of its submodules'): what
dynamo's guards check, so a loaded graph runs without them. A kind whose
call another graph compiled here passes the guards of (it differs in what
the graph does not read, e.g. an unread mask's shape) gets a file naming
that graph, as dynamo would reuse it. Files are also keyed by the torch
version, the thread count and the CPU's vector instructions (the generated
kernels depend on them), and a graph is compiled again when a source file
dynamo traced through has changed since it was saved.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from vllm_accel.log import get_logger

logger = get_logger(__name__)

# Graphs loaded and compiled in this process (CompileStats reads deltas).
_loaded = _compiled = 0


def counts() -> tuple[int, int]:
    """(graphs loaded, graphs compiled) through saved graphs so far; inductor's
    own cache is not consulted for these."""
    return _loaded, _compiled


def _savable_guards(entries):
    """Dynamo's guards that can be saved: not those on global state, on object
    identity, or on packed oneDNN weights (their layout has no meta tensor)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsavable = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    return [not (g.is_global or g.guard_type in unsavable
                 or (isinstance(g.value, torch.Tensor) and g.value.layout == torch._mkldnn))
            for g in entries]


@functools.cache
def available() -> bool:
    """Whether this torch saves compiled functions whole (``aot_compile`` on
    a ``torch.compile``'d function: torch 2.12 on; nothing compiles here)."""
    return hasattr(torch.compile(lambda x: x), "aot_compile")


def compile_ahead_of_time(function: Callable, backend: str) -> Callable:
    """``torch.compile(function)`` whose ``aot_compile`` result can be saved."""
    return torch.compile(function, backend=backend, dynamic=False, fullgraph=True,
                         options={"guard_filter_fn": _savable_guards})


class SavedGraphs:
    """Layer graphs saved in ``directory``: a file per graph (``KEY.graph``),
    and for a kind of call that another's graph serves, a file naming it
    (``KEY.same``)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._code: dict[str, Callable] = {}  # by the key of the graph's file
        self._same: dict[str, str] = {}  # a kind's key -> its graph's key
        # Graphs compiled in this process, with guards that work (after a
        # load they do not all pass: dynamo's marks on dynamic dimensions).
        self._fresh: list[tuple[str, Callable, tuple, object]] = []
        self._unsavable: set[Callable] = set()
        self._unsaved_logged = False

    def code_for(self, function: Callable, compiled: Callable, layer: nn.Module,
                 kind: tuple, args: tuple, kwargs: dict) -> Callable | None:
        """The code that runs ``compiled``'s graph for this call: from memory,
        from a file, a graph compiled here whose guards pass (an argument the
        graph does not read made another kind), or compiled now and saved.
        None where ``function``'s graphs cannot be saved (then dynamo's own
        path compiles them)."""
        if function in self._unsavable:
            return None
        key = _key(function, layer, kind)
        graph_key = self._same.get(key) or self._read_same(key) or key
        code = self._code.get(graph_key) or self._load(graph_key, function)
        if code is None:
            graph_key = self._fresh_graph_for(function, kind, layer, args, kwargs)
            if graph_key is not None:
                self._write(self._path(key, ".same"), graph_key.encode())
            else:
                graph_key = key
                code = self._compile(key, function, kind, compiled, layer, args, kwargs)
                if code is None:
                    return None
                self._code[key] = code
            code = self._code[graph_key]
        self._same[key] = graph_key
        return code

    def _path(self, key: str, suffix: str = ".graph") -> Path:
        return self.directory / f"{key}{suffix}"

    def _read_same(self, key: str) -> str | None:
        path = self._path(key, ".same")
        return path.read_text().strip() if path.exists() else None

    def _fresh_graph_for(self, function, kind, layer, args, kwargs) -> str | None:
        for graph_key, graph_function, graph_kind, compiled_fn in self._fresh:
            # Same grad and inference modes (global state, unguarded here).
            if (graph_function is function and graph_kind[:2] == kind[:2]
                    and compiled_fn.guard_check(layer, *args, **kwargs)):
                return graph_key
        return None

    def _load(self, key: str, function: Callable) -> Callable | None:
        global _loaded
        path = self._path(key)
        if not path.exists():
            return None
        try:
            with open(path, "rb") as f:
                saved = torch.compiler.load_compiled_function(f, f_globals=function.__globals__)
        except Exception as e:  # a file from another torch, cut short, ...: compile again
            logger.warning("vllm_accel: saved graph %s not loaded (%s); compiling it again",
                           path, e)
            return None
        if not _sources_unchanged(saved.source_info()):
            logger.info("vllm_accel: saved graph %s traced source that has changed; "
                        "compiling it again", path)
            return None
        _loaded += 1
        self._code[key] = saved.fn
        return saved.fn

    def _compile(self, key: str, function: Callable, kind: tuple, compiled: Callable,
                 layer: nn.Module, args: tuple, kwargs: dict) -> Callable:
        global _compiled
        # Dynamo saves the guarded layer's attributes with its guards: not
        # the compiled forward the layer holds (and the store behind it).
        own_forward = layer.__dict__.pop("forward", None)
        try:
            result = compiled.aot_compile(((layer, *args), kwargs))
        except Exception as e:  # e.g. guards on an object dynamo cannot save
            logger.warning("vllm_accel: %s's graphs cannot be saved (%s); compiling them "
                           "at every start", function.__qualname__, e)
            self._unsavable.add(function)
            return None
        finally:
            if own_forward is not None:
                layer.forward = own_forward
        _compiled += 1
        self._fresh.append((key, function, kind, result))
        try:
            data = type(result).serialize(result).serialized_data
        except Exception as e:  # it still runs here
            self._not_saved(e)
        else:
            self._write(self._path(key), data)
        return result.fn

    def _write(self, path: Path, data: bytes) -> None:
        """Whole or absent, for a start running beside this one."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.partial")
            partial.write_bytes(data)
            partial.replace(path)
        except OSError as e:  # a read-only cache: later starts compile again
            self._not_saved(e)

    def _not_saved(self, error: Exception) -> None:
        if not self._unsaved_logged:
            logger.warning("vllm_accel: compiled graphs not saved (%s); later starts "
                           "compile them again", error)
            self._unsaved_logged = True


def _key(function: Callable, layer: nn.Module, kind: tuple) -> str:
    parts = (function.__module__, function.__qualname__, torch.__version__,
             torch.get_num_threads(), torch.backends.cpu.get_cpu_capability(),
             _layer_fingerprint(layer), kind)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:40]


# Values a key can hold as they are (compile._call_kind's too).
PLAIN_TYPES = (bool, int, float, str, type(None))


def _layer_fingerprint(layer: nn.Module) -> tuple:
    """The layer as dynamo's guards see it: each submodule's class, its
    tensors' (parameters, buffers, tables) shapes, dtypes and layouts, and its
    plain attributes (sizes, flags, constants)."""
    described = []
    for name, module in layer.named_modules():
        tensors = [(n, tuple(t.shape), t.dtype, t.layout)
                   for n, t in (*module.named_parameters(recurse=False),
                                *module.named_buffers(recurse=False),
                                *((n, v) for n, v in vars(module).items()
                                  if isinstance(v, torch.Tensor)))]
        plain = sorted((n, v) for n, v in vars(module).items()
                       if isinstance(v, PLAIN_TYPES) or (isinstance(v, tuple)
                                                    and all(isinstance(i, PLAIN_TYPES) for i in v)))
        described.append((name, type(module).__module__, type(module).__qualname__,
                          tuple(tensors), tuple(plain)))
    return tuple(described)


def _sources_unchanged(source_info) -> bool:
    return all(_module_source(s.module) == s.content for s in source_info.inlined_sources)


@functools.cache
def _module_source(name: str) -> str | None:
    module = sys.modules.get(name)
    try:
        return inspect.getsource(module) if module is not None else None
    except (OSError, TypeError):
        return None
