"""Configuration: one frozen dataclass, validated once, with human sizes ("256MiB") in and out."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_mlp.errors import OffloadError

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
TRANSFERS = ("auto", "pinned", "plain")  # how subgroups move between host and device: see jax_mlp.transfer
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
            raise OffloadError(
                f"{name}={value!r} is not a size: write a number of bytes or a number with a unit "
                "such as '256MiB', '8GiB' or '500MB'"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    size = number * _UNITS[unit]
    if size < 0:
        raise OffloadError(f"{name}={value!r} must not be negative: give a size of 0 or more, such as '256MiB'")
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
        raise OffloadError(f"{name}={value!r} must be positive: give a rate such as '400MB/s', or None for none")
    return rate


def format_bytes(nbytes: float) -> str:
    """``nbytes`` with a binary unit, e.g. ``"1.5 MiB"``: the inverse of :func:`parse_size`, for messages.

    Args:
      nbytes: a number of bytes.

    Returns:
      The size, with one decimal above a KiB.
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{int(nbytes)} B" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


_URL_SCHEMES = {"s3": "s3", "gcs": "gs"}
"""The URL scheme of each object-store driver, for names: ``s3://bucket/prefix/``, ``gs://bucket/prefix/``."""


def _parse_url(url: str) -> str | dict:
    """A kvstore URL (``s3://bucket/prefix``, ``gs://bucket/prefix``, ``memory://...``) as a spec; ``file://`` as a directory."""
    import tensorstore as ts  # the spec parser of the kvstores themselves

    try:
        spec = ts.KvStore.Spec(url).to_json()
    except ValueError as error:
        raise OffloadError(
            f"path {url!r} is not a tensorstore kvstore URL ({error}): give a directory, a URL such as "
            "'s3://bucket/prefix' or 'gs://bucket/prefix', or a kvstore spec dict"
        ) from None
    if spec["driver"] == "file":
        return spec["path"]
    return spec


def _normalise_location(location: str | os.PathLike | dict) -> str | dict:
    """An absolute directory, or a tensorstore kvstore spec (a dict with a ``driver``, or parsed from a URL)."""
    if isinstance(location, dict):
        if "driver" not in location:
            raise OffloadError(
                f"path {location!r} is a dict but not a tensorstore kvstore spec: it needs a 'driver', "
                "e.g. {'driver': 'file', 'path': '/nvme/run'}"
            )
        return dict(location)
    text = os.fspath(location)
    if isinstance(text, str) and "://" in text:
        parsed = _parse_url(text)
        if isinstance(parsed, dict):
            return parsed
        text = parsed
    return os.path.abspath(os.path.expanduser(text))


def kvstore_url(spec: Mapping[str, Any]) -> str:
    """How messages and stats name a kvstore spec: ``s3://bucket/prefix/``, ``gs://bucket/prefix/``, ``memory://prefix/``.

    Args:
      spec: a tensorstore kvstore spec.

    Returns:
      The URL of the spec's prefix, ending in ``/``; an ``endpoint`` is not part of it.
    """
    prefix = spec.get("path", "")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    driver = spec["driver"]
    if driver in _URL_SCHEMES:
        return f"{_URL_SCHEMES[driver]}://{spec.get('bucket', '')}/{prefix}"
    return f"{driver}://{prefix}"


@dataclasses.dataclass(frozen=True, init=False)
class Path:
    """A storage path: a directory or tensorstore kvstore spec, with optional bandwidth figures.

    Caps are enforced (a token bucket in the tier layer): they emulate slower tiers on one disk and
    keep a shared file system polite. Declared bandwidths only inform placement and the model; when
    absent they come from ``probe=True``, from the caps, or from measurement while running.

    Args:
      location: a directory; an object-store URL such as ``"s3://bucket/prefix"`` or ``"gs://bucket/prefix"``
        (any tensorstore kvstore URL); or a tensorstore kvstore spec dict, e.g. with an S3 ``endpoint``.
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
        """What makes two paths the same storage: the real directory, or the spec (``run1`` and ``run1/`` alike)."""
        if isinstance(self.location, dict):
            return json.dumps({**self.location, "path": kvstore_url({**self.location})}, sort_keys=True)
        return os.path.realpath(self.location)

    @property
    def name(self) -> str:
        """How messages and stats name this path."""
        return kvstore_url(self.location) if isinstance(self.location, dict) else self.location


def as_path(path: str | os.PathLike | dict | Path) -> Path:
    """``path`` as a :class:`Path` (no caps, nothing declared, unless it already is one)."""
    return path if isinstance(path, Path) else Path(path)


def _shape_of(name: str, value: Any) -> jax.ShapeDtypeStruct:
    """The shape and dtype of an extra argument given as an array, a number or a ``ShapeDtypeStruct``."""
    try:
        return jax.ShapeDtypeStruct(np.shape(value), jnp.result_type(value))
    except TypeError as error:
        raise TypeError(
            f"extra_args[{name!r}] must be an array or a jax.ShapeDtypeStruct, got {type(value).__name__}: only "
            "arrays can be passed on to the inner optimizer"
        ) from error


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """Everything that configures one ``mlp_offload``: the one place its options are defined and checked.

    Human values are accepted and normalised once, here: a path-like or a list of them, sizes such
    as ``"8GiB"``, ``node_lock=True``. ``mlp_offload`` takes these same fields as keywords, and its
    docstring lists them from the one below.

    Attributes:
      paths: one or more directories (node-local NVMe, a parallel file system) for the state records;
        a path may also be an object store, as a URL (``"s3://bucket/prefix"``, ``"gs://bucket/prefix"``) or a
        tensorstore kvstore spec dict (e.g. ``{"driver": "s3", "bucket": ..., "endpoint": ..., "path": ...}``),
        or a :class:`Path` with bandwidth caps or declared bandwidths. Stored as a tuple of :class:`Path`.
      host_cache: host RAM for records kept between updates, e.g. ``"8GiB"``; 0 disables the cache.
      subgroup_size: bytes of state (plus master params) streamed at once, e.g. ``"256MiB"``.
      prefetch_depth: subgroups read ahead of the one being updated. 4 by default, so that with two
        paths each has two reads in flight and hides its latency (docs/tuning.md); each costs a record
        of host RAM and of device memory.
      write_depth: subgroups whose writes may trail behind the update (4 by default, a record of host
        RAM each).
      master_dtype: if set (e.g. ``jnp.float32``), an fp32 master copy of low-precision params is kept
        in the tiers, and ``optax.apply_updates(params, updates)`` gives exactly the new master's bf16 word.
      master_storage: how records hold the fp32 master of bf16 params: ``"full"`` (the default) keeps
        the whole master, so the tiers alone give the params back after a crash (``restore_params``);
        ``"remainder"`` keeps only its low 16 bits, the params on the device being the high half (2 bytes
        per param, not 4): a crashed run then resumes from your last checkpoint. Other dtypes always keep
        the whole master.
      io_timeout: seconds a single record read or write may take before the update fails.
      store_timeout: on an object store (a kvstore path), the seconds of retries, with exponential backoff,
        after a request fails for a transient reason (a 5xx reply, a refused or reset connection) before the
        read or write fails with a ``PathError`` naming the store. Bounds the wait for an unreachable store;
        tensorstore's own default would retry for about 15 minutes.
      peer_timeout: with several ``jax.distributed`` processes, seconds an update (or ``init``)
        waits for every peer to finish the same step; past it, the update raises: a peer died or hangs.
        Inside jit, also how long each device's callback waits for the other devices' and for the update.
      order: ``"alternate"`` (cache-friendly: ascending, then descending) or ``"ascending"``.
      flush: ``"idle"`` writes dirty cached records back between updates, so the paths always hold a
        complete step; ``"lazy"`` writes them only at eviction, ``flush()``, checkpoint or close.
      placement: ``"bandwidth"`` splits subgroups over paths by bandwidth; ``"round_robin"`` equally.
      rebalance: move subgroups to faster paths when measured throughputs drift apart.
      idle_prefetch: read the next update's first uncached records between updates.
      probe: measure each path's bandwidth at ``init`` (64 MiB each); declared bandwidths win.
      max_inflight: record transfers in flight at once per path, in this process.
      node_lock: ``True`` (or a node-local directory) to let only one process of a node use a given
        path at a time. Stored as the lock directory, or None.
      extra_args: the extra keyword arguments the inner optimizer's ``update`` needs, by name, as
        arrays or ``jax.ShapeDtypeStruct``s, e.g. ``{"value": jax.ShapeDtypeStruct((), jnp.float32)}``
        for a loss: ``init`` checks the optimizer with them, and ``update(..., value=loss)`` passes
        them to every subgroup alike. Stored as sorted ``(name, ShapeDtypeStruct)`` pairs.
      accumulate_steps: gradient accumulation over this many ``update`` calls, as ``optax.MultiSteps``
        around the inner optimizer: calls 1..k-1 fold the grads into a running mean held in the
        ``OffloadState`` and return zero updates (their idle time reads the state ahead); call k
        streams the state once, with the mean. 1 (the default) updates on every call. Eager only.
      accumulator_dtype: the floating dtype of that running mean of the grads, ``float32`` by default.
      transfer: how subgroups move between host and device: ``"pinned"`` through the device's
        ``pinned_host`` memory with zero-copy host views, ``"plain"`` by ``device_put`` and
        ``np.asarray``, or ``"auto"`` (pinned on GPUs that have it, plain elsewhere; the stats' ``transfer``
        says which ran). Both move the same bits.
    """

    paths: Sequence[str | os.PathLike | dict | Path] | str | os.PathLike | dict | Path
    host_cache: int | str = 0
    subgroup_size: int | str = "64MiB"
    prefetch_depth: int = 4
    write_depth: int = 4
    master_dtype: Any = None
    master_storage: str = "full"
    io_timeout: float = 600.0
    store_timeout: float = 30.0
    peer_timeout: float = 600.0
    order: str = "alternate"
    flush: str = "idle"
    placement: str = "bandwidth"
    rebalance: bool = True
    idle_prefetch: bool = True
    probe: bool = False
    max_inflight: int = 4
    node_lock: bool | str | os.PathLike | None = False
    extra_args: Mapping[str, Any] | Sequence[tuple[str, Any]] = ()
    accumulate_steps: int = 1
    accumulator_dtype: Any = np.float32
    transfer: str = "auto"

    def __post_init__(self) -> None:
        self._normalise()
        self._validate()

    def _normalise(self) -> None:
        paths = self.paths
        if isinstance(paths, (str, os.PathLike, dict, Path)):
            paths = [paths]
        node_lock = self.node_lock
        if node_lock is True:
            node_lock = os.path.join(tempfile.gettempdir(), "jax_mlp-locks")
        normalised = {
            "paths": tuple(as_path(p) for p in paths),
            "host_cache": parse_size(self.host_cache, name="host_cache"),
            "subgroup_size": parse_size(self.subgroup_size, name="subgroup_size"),
            "master_dtype": None if self.master_dtype is None else np.dtype(self.master_dtype),
            "node_lock": os.fspath(node_lock) if node_lock else None,
            "extra_args": tuple(sorted((str(k), _shape_of(k, v)) for k, v in dict(self.extra_args).items())),
            "accumulator_dtype": np.dtype(self.accumulator_dtype),
        }
        for name, value in normalised.items():
            object.__setattr__(self, name, value)

    def _validate(self) -> None:
        if not self.paths:
            raise OffloadError("paths is empty: give at least one directory for the offloaded state")
        seen: dict[str, str] = {}
        for path in self.paths:
            if path.identity in seen:
                raise OffloadError(
                    f"path {path.name!r} is given twice (it is the same storage as {seen[path.identity]!r}); "
                    "list each storage directory once"
                )
            seen[path.identity] = path.name
        if self.host_cache < 0:
            raise OffloadError(
                f"host_cache must not be negative, got {self.host_cache}: give 0 for no cache, or a size"
            )
        _check_host_cache(self.host_cache)
        if self.subgroup_size <= 0:
            raise OffloadError(
                f"subgroup_size must be positive, got {self.subgroup_size}: give the bytes of state to stream at "
                "once, such as '64MiB' (the default)"
            )
        if self.master_storage not in ("remainder", "full"):
            raise OffloadError(
                f"master_storage must be 'remainder' or 'full', got {self.master_storage!r}: pass one of those"
            )
        if self.order not in ("alternate", "ascending"):
            raise OffloadError(f"order must be 'alternate' or 'ascending', got {self.order!r}: pass one of those")
        if self.placement not in ("bandwidth", "round_robin"):
            raise OffloadError(
                f"placement must be 'bandwidth' or 'round_robin', got {self.placement!r}: pass one of those"
            )
        if self.transfer not in TRANSFERS:
            raise OffloadError(f"transfer must be one of {TRANSFERS}, got {self.transfer!r}: pass one of those")
        if self.flush not in ("idle", "lazy"):
            raise OffloadError(f"flush must be 'idle' or 'lazy', got {self.flush!r}: pass one of those")
        for name in ("prefetch_depth", "write_depth", "max_inflight"):
            if getattr(self, name) < 1:
                raise OffloadError(f"{name} must be at least 1, got {getattr(self, name)}: pass 1 or more")
        for name in ("io_timeout", "store_timeout", "peer_timeout"):
            if getattr(self, name) <= 0:
                raise OffloadError(f"{name} must be positive, got {getattr(self, name)}: pass a number of seconds")
        if self.master_dtype is not None and not jnp.issubdtype(self.master_dtype, jnp.floating):
            raise OffloadError(
                f"master_dtype must be a floating dtype, got {self.master_dtype}: pass jnp.float32, or None for no "
                "master copy"
            )
        steps = self.accumulate_steps
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
            raise OffloadError(
                f"accumulate_steps must be a whole number of calls, at least 1, got {steps!r}: pass an int such as 4, "
                "or 1 for no accumulation"
            )
        if not jnp.issubdtype(self.accumulator_dtype, jnp.floating):
            raise OffloadError(
                f"accumulator_dtype must be a floating dtype, got {self.accumulator_dtype}: pass jnp.float32 (the "
                "default) or jnp.bfloat16"
            )

    @classmethod
    def options_doc(cls) -> str:
        """The "Attributes" section of this docstring: the options' documentation, for ``mlp_offload``'s."""
        text = inspect.cleandoc(cls.__doc__ or "")
        return text[text.index("Attributes:\n") + len("Attributes:\n") :]


def total_memory() -> int | None:
    """This machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_host_cache(host_cache: int) -> None:
    """Refuses a host cache larger than this machine's physical memory: it could never be held.

    Physical memory, not what is free now: the cache fills over the first updates, and what other
    processes leave free changes as they come and go, so only a size that can never fit is refused.

    Raises:
      OffloadError: with both figures.
    """
    memory = total_memory()
    if memory is not None and host_cache > memory:
        raise OffloadError(
            f"host_cache={format_bytes(host_cache)} is larger than this machine's memory ({format_bytes(memory)}); "
            "give a cache that fits beside the process (a fraction of the memory), or host_cache=0 for none"
        )
