"""The import hook behind the patches that wait for a module to be imported
(``vllm_accel/patches.py``: 1, 2, 9-11 and 17, which says what and why).

``ShimFinder`` goes first on ``sys.meta_path`` and answers only for the module
names its ``route`` knows; every other import passes it by. For a name it
knows, ``route`` returns either

- an ``Alias``: the name is loaded as another, already importable module;
  both names then refer to the same module object, or
- a hook: the module is found by the other finders and loaded as usual, then
  the hook runs (to patch the fresh module).

Standard library only, so that it loads wherever patches.py does (also
outside the package: benchmarks/native_shims.py).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Union


@dataclass(frozen=True)
class Alias:
    """Load the module name asked for as ``target``."""

    target: str


Route = Callable[[str], Optional[Union[Alias, Callable[[], None]]]]


class ShimFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder that only answers for the module names ``route`` knows
    (it returns None for the others)."""

    def __init__(self, route: Route):
        self._route = route

    def find_spec(self, fullname, path=None, target=None):
        action = self._route(fullname)
        if action is None:
            return None
        if isinstance(action, Alias):
            return importlib.util.spec_from_loader(fullname, _AliasLoader(action.target))
        spec = _find_spec_elsewhere(self, fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _PostImportLoader(spec.loader, action)
        return spec


def _find_spec_elsewhere(skip, fullname, path, target):
    for finder in sys.meta_path:
        if finder is skip or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads a module name as another, already importable module: both
    names then refer to the same module object."""

    def __init__(self, target: str):
        self.target = target
        self._own_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module):
        # The import system stamped the alias spec on the target module;
        # give it its own back (it was executed under its own name).
        module.__spec__ = self._own_spec


class _PostImportLoader(importlib.abc.Loader):
    """Runs the real loader, then a hook on the fresh module."""

    def __init__(self, loader, hook):
        self._loader = loader
        self._hook = hook

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        # Put the real loader back where the import system put us.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._hook()

    def __getattr__(self, name):  # get_source, get_filename, is_package, ...
        return getattr(self._loader, name)
