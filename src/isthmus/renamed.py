"""Old module paths that still import, with a DeprecationWarning naming the new one.

Modules were renamed so that no two share a name for different things, and each strategy's math
moved next to its strategy. A script that imports an old path (``from isthmus.comm.config
import SessionConfig``) keeps working: :func:`install` (called by the package's ``__init__``)
puts a finder on ``sys.meta_path`` that answers an old name with the module at its new path,
the very same module object, so names, classes and ``isinstance`` checks agree. Only modules
that were moved whole are listed; a module that was split in two (``strategies.overlap``) has no
single new home and is not.

Part of the floor: imports nothing of isthmus at import time (the new module is imported by
name, when an old one is asked for).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__all__ = ["RENAMED", "install"]

RENAMED: dict[str, str] = {
    "isthmus.run.churn": "isthmus.run.churn_hook",
    "isthmus.lab.churn": "isthmus.lab.churn_plan",
    "isthmus.lab.probe": "isthmus.lab.linkprobe",
    "isthmus.coordinator.web.auth": "isthmus.coordinator.web.viewer_auth",
    "isthmus.run.lab": "isthmus.run.lab_run",
    "isthmus.run.builtin": "isthmus.run.builtin_run",
    "isthmus.run.script": "isthmus.run.script_run",
    "isthmus.comm.config": "isthmus.comm.session_config",
    "isthmus.strategies.gossip.config": "isthmus.strategies.gossip.options",
    "isthmus.checkpoint.tools": "isthmus.checkpoint.inspect",
    "isthmus.cli.tools": "isthmus.cli.checkpoint_data",
    "isthmus.reduce.compress.base": "isthmus.reduce.compress.compressor",
    "isthmus.reduce.aggregate.base": "isthmus.reduce.aggregate.aggregator",
    "isthmus.reduce.sparseloco_math": "isthmus.strategies.sparseloco.math",
    "isthmus.reduce.demo_math": "isthmus.strategies.decoupled_momentum.math",
    "isthmus.reduce.zo_math": "isthmus.strategies.zo.math",
    "isthmus.reduce.zo_log": "isthmus.strategies.zo.replay",
    "isthmus.strategies.demo": "isthmus.strategies.decoupled_momentum",
    "isthmus.reduce.gossip": "isthmus.strategies.gossip.math",
}
"""Old dotted module path -> the path the same module lives at now."""


class _Loader(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"module {spec.name} is deprecated: import {self.new}",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        # The module was executed under its new name already; executing it again would make a
        # second copy of every class.
        return None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = RENAMED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (idempotent). It answers only the old names in
    :data:`RENAMED`; every other import goes to the finders after it."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
