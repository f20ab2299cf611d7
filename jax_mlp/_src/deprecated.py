"""The import paths of jax_mlp's flat layout (``jax_mlp.partition``, ``jax_mlp.scheduler``, ...), for one release.

Before 0.2 the package was 30 modules side by side, and the docs showed some of them
(``jax_mlp.partition.Plan``, ``jax_mlp.dependence.check_optimizer``, ``python -m jax_mlp.cli``). They
now live in ``jax_mlp._src``'s layers, and what users need is exported by ``jax_mlp`` itself. Each old
path still imports, as a module that looks its names up in the new modules and warns once with a
``DeprecationWarning`` naming what to import instead. ``python -m`` of an old module runs its new one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any

_STORAGE = (
    "backend",
    "buffers",
    "cache",
    "capacity",
    "chunk_files",
    "kvstore",
    "local",
    "ownership",
    "paths",
    "record",
    "tier_stack",
    "traffic",
)

MOVED: dict[str, tuple[str, ...]] = {
    "jax_mlp.accumulation": ("offload.accumulation",),
    "jax_mlp.blocks": ("stream.blocks",),
    "jax_mlp.calls": ("offload.calls",),
    "jax_mlp.checkpoint": (
        "checkpoint.handler",
        "checkpoint.params",
        "checkpoint.layout",
        "checkpoint.save",
        "checkpoint.restore",
    ),
    "jax_mlp.checkpoint_layout": ("checkpoint.layout",),
    "jax_mlp.cli": ("cli.main", "cli.command", "cli.plan_command", "cli.probe_command", "cli.speeds"),
    "jax_mlp.config": ("config", "parsing"),
    "jax_mlp.dependence": ("plan.optimizer_check", "plan.dependencies"),
    "jax_mlp.engine": ("stream.engine",),
    "jax_mlp.errors": ("errors",),
    "jax_mlp.idle": ("stream.idle",),
    "jax_mlp.in_jit": ("offload.in_jit",),
    "jax_mlp.inputs": ("offload.inputs",),
    "jax_mlp.model": ("schedule.performance", "cli.ablation", "cli.sizing"),
    "jax_mlp.offloader": ("offload.offloader", "state"),
    "jax_mlp.partition": ("plan.partition",),
    "jax_mlp.peers": ("peers", "errors"),
    "jax_mlp.programs": ("plan.programs",),
    "jax_mlp.remainders": ("plan.remainders",),
    "jax_mlp.resume": ("offload.resume",),
    "jax_mlp.run": ("offload.calls",),
    "jax_mlp.scheduler": ("schedule.scheduler", "schedule.estimates"),
    "jax_mlp.sharding": ("plan.sharding",),
    "jax_mlp.state": ("state",),
    "jax_mlp.stats": ("stats", "parsing"),
    "jax_mlp.step": ("stream.state_stream",),
    "jax_mlp.storage": ("storage",),
    "jax_mlp.transfer": ("stream.transfer",),
    "jax_mlp.transform": ("transform",),
    **{f"jax_mlp.storage.{name}": (f"storage.{name}",) for name in _STORAGE},
    "jax_mlp.storage.probe": ("storage.bandwidth",),
}
"""Each old module path, and the modules under ``jax_mlp._src`` that now hold its names (searched in order)."""


def _targets(old: str) -> list[types.ModuleType]:
    return [importlib.import_module(f"jax_mlp._src.{new}") for new in MOVED[old]]


class _Moved(types.ModuleType):
    """An old module path: each attribute is looked up in the modules that now hold it."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        for target in _targets(self.__name__):
            if hasattr(target, name):
                return getattr(target, name)
        raise AttributeError(f"module {self.__name__!r} (moved to jax_mlp._src) has no attribute {name!r}")

    def __dir__(self) -> list[str]:
        return sorted({name for target in _targets(self.__name__) for name in dir(target)})


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warn(spec.name, stacklevel=2)
        return _Moved(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ == "jax_mlp.storage":
            module.__path__ = []  # a package: ``import jax_mlp._src.storage.paths`` finds its submodules here too

    def get_code(self, name: str) -> types.CodeType:
        """``python -m`` of an old module: runs its new one as ``__main__``."""
        warn(name, stacklevel=2)
        target = f"jax_mlp._src.{MOVED[name][0]}"
        return compile(
            f"import runpy\nrunpy.run_module({target!r}, run_name='__main__', alter_sys=True)\n", name, "exec"
        )


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(name, _Loader(), is_package=name == "jax_mlp.storage")


def warn(old: str, stacklevel: int = 1) -> None:
    """Warns that ``old`` moved, and says what to import instead."""
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release: import the public names from jax_mlp "
        f"(jax_mlp.Plan, jax_mlp.format_bytes, ...; see docs/api.md); the module itself is now the private "
        f"jax_mlp._src.{MOVED[old][0]}",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


def install() -> None:
    """Makes the old module paths importable (once per process)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())  # before path finders: a stale copy of an old module never wins
