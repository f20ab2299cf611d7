"""Configuration: one frozen dataclass, validated once, with human sizes ("256MiB")."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, *, name: str = "size") -> int:
    """Parses a byte count: an int, or a string such as ``"256MiB"``, ``"1.5GB"`` or ``"0"``.

    Args:
      value: the size, as a number of bytes or a string with a unit (B, KB, MB, GB, TB, KiB, ...).
      name: the option's name, used in the error message.

    Returns:
      The size in bytes.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a size such as 268435456 or '256MiB', got {value!r}")
    if isinstance(value, (int, float, np.integer, np.floating)):
        number, unit = float(value), ""
    else:
        match = _SIZE_RE.match(str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"{name}={value!r} is not a size: write a number of bytes or a number with a unit "
                "such as '256MiB', '8GiB' or '500MB'"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    size = number * _UNITS[unit]
    if size < 0:
        raise ValueError(f"{name}={value!r} must not be negative")
    return int(size)


def _normalise_path(path: str | os.PathLike | dict) -> str | dict:
    """An absolute directory, or a tensorstore kvstore spec (a dict with a ``driver``) as given."""
    if isinstance(path, dict):
        if "driver" not in path:
            raise ValueError(f"path {path!r} is a dict but not a tensorstore kvstore spec: it needs a 'driver'")
        return dict(path)
    return os.path.abspath(os.path.expanduser(os.fspath(path)))


def _identity(path: str | dict) -> str:
    return json.dumps(path, sort_keys=True) if isinstance(path, dict) else os.path.realpath(path)


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """Everything that configures one ``mlp_offload``; checked once, here.

    Attributes:
      paths: storage directories, one per tier path (node-local NVMe, a PFS directory, ...), or
        tensorstore kvstore specs (dicts with a ``driver``).
      host_cache: bytes of host RAM that may hold records between updates (0 disables it).
      subgroup_size: target bytes of optimizer state (plus master params) per subgroup.
      prefetch_depth: how many subgroups are read ahead of the one being updated.
      write_depth: how many subgroups may be in flight to the paths behind the update.
      master_dtype: dtype of a master copy of the params kept in the tiers, or None.
      io_timeout: seconds after which a single read or write counts as hung and raises.
    """

    paths: tuple[str | dict, ...]
    host_cache: int = 0
    subgroup_size: int = 64 * 1024**2
    prefetch_depth: int = 2
    write_depth: int = 2
    master_dtype: Any = None
    io_timeout: float = 600.0

    def __post_init__(self) -> None:
        if not self.paths:
            raise ValueError("paths is empty: give at least one directory for the offloaded state")
        seen: dict[str, str | dict] = {}
        for path in self.paths:
            real = _identity(path)
            if real in seen:
                raise ValueError(
                    f"path {path!r} is given twice (it is the same directory as {seen[real]!r}); "
                    "list each storage directory once"
                )
            seen[real] = path
        if self.host_cache < 0:
            raise ValueError(f"host_cache must not be negative, got {self.host_cache}")
        if self.subgroup_size <= 0:
            raise ValueError(f"subgroup_size must be positive, got {self.subgroup_size}")
        for name in ("prefetch_depth", "write_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.io_timeout <= 0:
            raise ValueError(f"io_timeout must be positive, got {self.io_timeout}")
        if self.master_dtype is not None and not jnp.issubdtype(self.master_dtype, jnp.floating):
            raise ValueError(f"master_dtype must be a floating dtype such as jnp.float32, got {self.master_dtype}")

    @classmethod
    def create(
        cls,
        paths: Sequence[str | os.PathLike | dict] | str | os.PathLike,
        *,
        host_cache: int | str = 0,
        subgroup_size: int | str = "64MiB",
        prefetch_depth: int = 2,
        write_depth: int = 2,
        master_dtype: Any = None,
        io_timeout: float = 600.0,
    ) -> OffloadConfig:
        """Builds a config from user-facing values: path-likes and human sizes."""
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        return cls(
            paths=tuple(_normalise_path(p) for p in paths),
            host_cache=parse_size(host_cache, name="host_cache"),
            subgroup_size=parse_size(subgroup_size, name="subgroup_size"),
            prefetch_depth=int(prefetch_depth),
            write_depth=int(write_depth),
            master_dtype=None if master_dtype is None else np.dtype(master_dtype),
            io_timeout=float(io_timeout),
        )
