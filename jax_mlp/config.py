"""Configuration: one frozen dataclass, validated once, with human sizes ("256MiB")."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
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


def parse_rate(value: int | float | str | None, *, name: str = "rate") -> float | None:
    """Parses a bandwidth: bytes per second, or a string such as ``"400MB/s"`` or ``"2GiB/s"``.

    Args:
      value: the rate, None for none.
      name: the option's name, used in the error message.

    Returns:
      Bytes per second (positive), or None.
    """
    if value is None:
        return None
    text = value.strip().removesuffix("/s") if isinstance(value, str) else value
    rate = float(parse_size(text, name=name))
    if rate <= 0:
        raise ValueError(f"{name}={value!r} must be positive")
    return rate


def _normalise_location(location: str | os.PathLike | dict) -> str | dict:
    """An absolute directory, or a tensorstore kvstore spec (a dict with a ``driver``) as given."""
    if isinstance(location, dict):
        if "driver" not in location:
            raise ValueError(f"path {location!r} is a dict but not a tensorstore kvstore spec: it needs a 'driver'")
        return dict(location)
    return os.path.abspath(os.path.expanduser(os.fspath(location)))


@dataclasses.dataclass(frozen=True, init=False)
class Path:
    """A storage path: a directory or tensorstore kvstore spec, with optional bandwidth figures.

    Caps are enforced (a token bucket in the tier layer): they emulate slower tiers on one disk and
    keep a shared file system polite. Declared bandwidths only inform placement and the model; when
    absent they come from ``probe=True``, from the caps, or from measurement while running.

    Args:
      location: a directory, or a tensorstore kvstore spec dict.
      max_read: cap on read bandwidth, e.g. ``"400MB/s"``.
      max_write: cap on write bandwidth.
      read_bandwidth: declared read bandwidth, e.g. ``"5GB/s"``.
      write_bandwidth: declared write bandwidth.
    """

    location: str | dict
    max_read: float | None
    max_write: float | None
    read_bandwidth: float | None
    write_bandwidth: float | None

    def __init__(
        self,
        location: str | os.PathLike | dict,
        *,
        max_read: float | str | None = None,
        max_write: float | str | None = None,
        read_bandwidth: float | str | None = None,
        write_bandwidth: float | str | None = None,
    ):
        object.__setattr__(self, "location", _normalise_location(location))
        for name, value in (
            ("max_read", max_read),
            ("max_write", max_write),
            ("read_bandwidth", read_bandwidth),
            ("write_bandwidth", write_bandwidth),
        ):
            object.__setattr__(self, name, parse_rate(value, name=name))

    @property
    def identity(self) -> str:
        """What makes two paths the same storage: the real directory, or the spec."""
        if isinstance(self.location, dict):
            return json.dumps(self.location, sort_keys=True)
        return os.path.realpath(self.location)

    @property
    def name(self) -> str:
        """How messages and stats name this path."""
        if isinstance(self.location, dict):
            return f"{self.location['driver']}://{self.location.get('path', '')}"
        return self.location


def as_path(path: str | os.PathLike | dict | Path) -> Path:
    """``path`` as a :class:`Path` (no caps, nothing declared, unless it already is one)."""
    return path if isinstance(path, Path) else Path(path)


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """Everything that configures one ``mlp_offload``; checked once, here.

    Attributes:
      paths: the storage paths (node-local NVMe, a PFS directory, a kvstore spec, ...), with their caps.
      host_cache: bytes of host RAM that may hold records between updates (0 disables it).
      subgroup_size: target bytes of optimizer state (plus master params) per subgroup.
      prefetch_depth: how many subgroups are read ahead of the one being updated.
      write_depth: how many subgroups may be in flight to the paths behind the update.
      master_dtype: dtype of a master copy of the params kept in the tiers, or None.
      io_timeout: seconds after which a single read or write counts as hung and raises.
      peer_timeout: with several ``jax.distributed`` processes, seconds an update waits for the
        slowest peer to finish the same step before it raises (a peer died or hangs); inside jit,
        also how long each device's callback waits for the other devices' and for the update.
      order: ``"alternate"`` (ascending, then descending: the cache-friendly order) or ``"ascending"``.
      flush: ``"idle"`` writes dirty cached records back between updates; ``"lazy"`` only at eviction,
        ``flush()``, checkpoint or close (the paper's behaviour).
      placement: ``"bandwidth"`` splits subgroups over paths in proportion to their bandwidth;
        ``"round_robin"`` splits them equally (a fixed ratio, as in the paper).
      rebalance: move subgroups towards faster paths when measured throughputs drift apart.
      idle_prefetch: read the next update's first uncached records between updates.
      probe: measure each path's bandwidth at ``init`` (declared bandwidths win).
      max_inflight: record reads and writes in flight at once on one path, in this process.
      node_lock: a node-local directory for cross-process locks: then only one process of the node
        reads or writes a given path at a time. None disables the lock.
    """

    paths: tuple[Path, ...]
    host_cache: int = 0
    subgroup_size: int = 64 * 1024**2
    prefetch_depth: int = 2
    write_depth: int = 2
    master_dtype: Any = None
    io_timeout: float = 600.0
    peer_timeout: float = 600.0
    order: str = "alternate"
    flush: str = "idle"
    placement: str = "bandwidth"
    rebalance: bool = True
    idle_prefetch: bool = True
    probe: bool = False
    max_inflight: int = 4
    node_lock: str | None = None

    def __post_init__(self) -> None:
        if not self.paths:
            raise ValueError("paths is empty: give at least one directory for the offloaded state")
        seen: dict[str, str] = {}
        for path in self.paths:
            if path.identity in seen:
                raise ValueError(
                    f"path {path.name!r} is given twice (it is the same storage as {seen[path.identity]!r}); "
                    "list each storage directory once"
                )
            seen[path.identity] = path.name
        if self.host_cache < 0:
            raise ValueError(f"host_cache must not be negative, got {self.host_cache}")
        if self.subgroup_size <= 0:
            raise ValueError(f"subgroup_size must be positive, got {self.subgroup_size}")
        if self.order not in ("alternate", "ascending"):
            raise ValueError(f"order must be 'alternate' or 'ascending', got {self.order!r}")
        if self.placement not in ("bandwidth", "round_robin"):
            raise ValueError(f"placement must be 'bandwidth' or 'round_robin', got {self.placement!r}")
        if self.flush not in ("idle", "lazy"):
            raise ValueError(f"flush must be 'idle' or 'lazy', got {self.flush!r}")
        for name in ("prefetch_depth", "write_depth", "max_inflight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("io_timeout", "peer_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.master_dtype is not None and not jnp.issubdtype(self.master_dtype, jnp.floating):
            raise ValueError(f"master_dtype must be a floating dtype such as jnp.float32, got {self.master_dtype}")

    @classmethod
    def create(
        cls,
        paths: Sequence[str | os.PathLike | dict | Path] | str | os.PathLike | Path,
        *,
        host_cache: int | str = 0,
        subgroup_size: int | str = "64MiB",
        node_lock: bool | str | os.PathLike = False,
        **options: Any,
    ) -> OffloadConfig:
        """Builds a config from user-facing values: path-likes, human sizes and ``node_lock=True``.

        ``options`` are the other fields, as :func:`jax_mlp.mlp_offload` documents them.
        """
        if isinstance(paths, (str, os.PathLike, dict, Path)):
            paths = [paths]
        if options.get("master_dtype") is not None:
            options["master_dtype"] = np.dtype(options["master_dtype"])
        if node_lock is True:
            node_lock = os.path.join(tempfile.gettempdir(), "jax_mlp-locks")
        return cls(
            paths=tuple(as_path(p) for p in paths),
            node_lock=os.fspath(node_lock) if node_lock else None,
            host_cache=parse_size(host_cache, name="host_cache"),
            subgroup_size=parse_size(subgroup_size, name="subgroup_size"),
            **options,
        )
