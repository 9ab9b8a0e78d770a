"""Old module paths that still import: each name in `MOVED` is the module now at its new place.

A module that moves leaves no file behind (so version control follows the file); importing the old
path finds the new module through `AliasFinder`, which `fullshard/__init__` installs. Both paths
give the same module object, so `isinstance` checks and monkeypatching see one module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    "fullshard.checkpoint.export": "fullshard.hf.export",
    "fullshard.checkpoint.offline": "fullshard.hf.offline",
    "fullshard.weights": "fullshard.hf.stream",
    "fullshard.towers": "fullshard.plan.towers",
    "fullshard.train.memory": "fullshard.plan.memory",
    "fullshard.strategy": "fullshard.faces.lightrft",
    # the test harnesses left the package for tests/harness/ (not shipped): these resolve where
    # tests/ is on the path, as in the test suite and the benchmarks
    "fullshard.testing.compare": "harness.compare",
    "fullshard.testing.vlm_parity": "harness.vlm_parity",
    "fullshard.testing.memory_matrix": "harness.memory_matrix",
}


class AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path in `MOVED` and loads it as the module at the new one."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        return None  # a placeholder: exec_module puts the real module in its place

    def exec_module(self, module) -> None:
        # the import system returns whatever sys.modules holds under the name once this returns
        sys.modules[module.__name__] = importlib.import_module(MOVED[module.__name__])


def install() -> None:
    if not any(isinstance(finder, AliasFinder) for finder in sys.meta_path):
        sys.meta_path.append(AliasFinder())
