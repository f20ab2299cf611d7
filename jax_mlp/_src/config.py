"""Configuration: one frozen dataclass, validated once, with human sizes ("256MiB") and typed choices."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import tempfile
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Required, TypedDict

import jax
import jax.numpy as jnp
import numpy as np

from jax_mlp._src.errors import OffloadError
from jax_mlp._src.parsing import format_bytes, kvstore_url, parse_location, parse_rate, parse_size

Order = Literal["alternate", "ascending"]
"""The order subgroups are updated in: ascending, then descending (cache-friendly), or always ascending."""
Flush = Literal["idle", "lazy"]
"""When dirty cached records are written: between updates, or only when evicted."""
Placement = Literal["bandwidth", "round_robin"]
"""How subgroups are spread over the paths: by bandwidth (rebalanced), or equally."""
TransferChoice = Literal["auto", "pinned", "plain"]
"""How subgroups move between host and device (see ``stream/transfer.py``)."""
MasterStorage = Literal["full", "remainder"]
"""How records hold the fp32 master of bf16 params: whole, or as its int16 low half."""
OverlapMode = Literal["timed", "always"]
"""Whether a backward that applies ``offload.overlap`` starts the update: when timed faster than the split
step (``"timed"``), or always (see ``schedule/overlap_choice.py``)."""


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
        object.__setattr__(self, "location", parse_location(location))
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


class OffloadOptions(TypedDict, total=False):
    """The options of :func:`~jax_mlp.mlp_offload` as type checkers see them: ``OffloadConfig``'s arguments.

    ``mlp_offload(inner, **options: Unpack[OffloadOptions])``; each is documented and validated by
    :class:`OffloadConfig` (``tests/test_config.py`` holds the two to the same names and types).
    """

    paths: Required[Sequence[str | os.PathLike | dict | Path] | str | os.PathLike | dict | Path]
    host_cache: int | str
    subgroup_size: int | str
    prefetch_depth: int
    write_depth: int
    master_dtype: Any
    master_storage: MasterStorage
    io_timeout: float
    store_timeout: float
    peer_timeout: float
    order: Order
    flush: Flush
    placement: Placement
    rebalance: bool
    idle_prefetch: bool
    probe: bool
    max_inflight: int
    node_lock: bool | str | os.PathLike | None
    extra_args: Mapping[str, Any] | Sequence[tuple[str, Any]]
    accumulate_steps: int
    accumulator_dtype: Any
    transfer: TransferChoice
    overlap_mode: OverlapMode


@dataclasses.dataclass(frozen=True, init=False)
class OffloadConfig:
    """Everything that configures one ``mlp_offload``: the one place its options are defined and checked.

    Human values are accepted and normalised once, here: a path-like or a list of them, sizes such
    as ``"8GiB"``, ``node_lock=True``; each field then holds the type it is annotated with. The string
    choices are ``Literal`` types, checked here. ``mlp_offload`` takes these same options as keywords,
    and its docstring lists them from the one below.

    Example:
      >>> import jax_mlp
      >>> config = jax_mlp.OffloadConfig("/tmp/run1", host_cache="1GiB", order="ascending")
      >>> config.host_cache, config.paths[0].location, config.order
      (1073741824, '/tmp/run1', 'ascending')

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
      overlap_mode: with ``offload.overlap`` in the loss, ``"timed"`` times overlapped and split steps
        side by side and runs the faster (tried again every 100 steps; the stats' ``overlap_fallback``
        says which runs), ``"always"`` starts every update in the backward. Both give the same bits.
    """

    paths: tuple[Path, ...]
    host_cache: int
    subgroup_size: int
    prefetch_depth: int
    write_depth: int
    master_dtype: np.dtype | None
    master_storage: MasterStorage
    io_timeout: float
    store_timeout: float
    peer_timeout: float
    order: Order
    flush: Flush
    placement: Placement
    rebalance: bool
    idle_prefetch: bool
    probe: bool
    max_inflight: int
    node_lock: str | None
    extra_args: tuple[tuple[str, jax.ShapeDtypeStruct], ...]
    accumulate_steps: int
    accumulator_dtype: np.dtype
    transfer: TransferChoice
    overlap_mode: OverlapMode

    def __init__(
        self,
        paths: Sequence[str | os.PathLike | dict | Path] | str | os.PathLike | dict | Path,
        *,
        host_cache: int | str = 0,
        subgroup_size: int | str = "64MiB",
        prefetch_depth: int = 4,
        write_depth: int = 4,
        master_dtype: Any = None,
        master_storage: MasterStorage = "full",
        io_timeout: float = 600.0,
        store_timeout: float = 30.0,
        peer_timeout: float = 600.0,
        order: Order = "alternate",
        flush: Flush = "idle",
        placement: Placement = "bandwidth",
        rebalance: bool = True,
        idle_prefetch: bool = True,
        probe: bool = False,
        max_inflight: int = 4,
        node_lock: bool | str | os.PathLike | None = False,
        extra_args: Mapping[str, Any] | Sequence[tuple[str, Any]] = (),
        accumulate_steps: int = 1,
        accumulator_dtype: Any = np.float32,
        transfer: TransferChoice = "auto",
        overlap_mode: OverlapMode = "timed",
    ):
        given = {name: value for name, value in locals().items() if name != "self"}  # every option, as given
        for name, value in {**given, **_normalised(given)}.items():
            object.__setattr__(self, name, value)
        self._validate()

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
        _check_host_cache(self.host_cache)
        if self.subgroup_size <= 0:
            raise OffloadError(
                f"subgroup_size must be positive, got {self.subgroup_size}: give the bytes of state to stream at "
                "once, such as '64MiB' (the default)"
            )
        for name, choices in _choices().items():
            if getattr(self, name) not in choices:
                raise OffloadError(f"{name} must be one of {choices}, got {getattr(self, name)!r}: pass one of those")
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

    @classmethod
    def of(cls, options: Mapping[str, Any], caller: str) -> OffloadConfig:
        """The config of the keyword ``options`` a face function (``caller``) was given.

        Raises:
          TypeError: an option that is not a field, named as ``caller``'s unexpected keyword.
        """
        unknown = sorted(set(options) - set(inspect.signature(cls).parameters))
        if unknown:
            raise TypeError(f"{caller}() got unexpected keyword arguments {unknown}; see help(jax_mlp.{caller})")
        return cls(**options)

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Each option's default, by name (``paths`` has none)."""
        parameters = inspect.signature(cls).parameters.values()
        return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def _normalised(given: dict[str, Any]) -> dict[str, Any]:
    """The options that are normalised: paths as a tuple of :class:`Path`, sizes as ints, dtypes as numpy's."""
    paths = given["paths"]
    if isinstance(paths, (str, os.PathLike, dict, Path)):
        paths = [paths]
    node_lock = given["node_lock"]
    if node_lock is True:
        node_lock = os.path.join(tempfile.gettempdir(), "jax_mlp-locks")
    master_dtype = given["master_dtype"]
    return {
        "paths": tuple(as_path(p) for p in paths),
        "host_cache": parse_size(given["host_cache"], name="host_cache"),
        "subgroup_size": parse_size(given["subgroup_size"], name="subgroup_size"),
        "master_dtype": None if master_dtype is None else np.dtype(master_dtype),
        "node_lock": os.fspath(node_lock) if node_lock else None,
        "extra_args": tuple(sorted((str(k), _shape_of(k, v)) for k, v in dict(given["extra_args"]).items())),
        "accumulator_dtype": np.dtype(given["accumulator_dtype"]),
    }


@functools.cache
def _choices() -> dict[str, tuple[str, ...]]:
    """The options typed as a ``Literal``, with their choices."""
    hints = typing.get_type_hints(OffloadConfig, globalns=globals())  # its __module__ is the public face
    return {
        field.name: typing.get_args(hints[field.name])
        for field in dataclasses.fields(OffloadConfig)
        if typing.get_origin(hints[field.name]) is Literal
    }


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
