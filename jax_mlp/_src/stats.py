"""Telemetry: what one update moved and where its time went, in a form that is easy to log."""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import jax

from jax_mlp._src.errors import OffloadError
from jax_mlp._src.parsing import format_bytes

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = threading.local()
EVENT_KINDS = ("read", "compute", "write")


def _count_compile(event: str, duration_secs: float, **_: Any) -> None:
    if event == _BACKEND_COMPILE_EVENT:
        _compiles.count = compiles_on_this_thread() + 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def compiles_on_this_thread() -> int:
    """XLA compilations run on the calling thread so far (jit caches hits are not counted)."""
    return getattr(_compiles, "count", 0)


class IOEvent(NamedTuple):
    """One timed piece of an update's work.

    Attributes:
      kind: ``"read"`` or ``"write"`` of a record on a path, or ``"compute"``: dispatching the jitted
        inner update of one subgroup (asynchronous, so the device may still be busy after ``end``).
      path: the path read or written; None for compute.
      subgroup: the subgroup's index.
      start: seconds from the start of the update; negative for work done before it, between
        updates (idle-time write-backs and reads ahead of the previous update).
      end: seconds from the start of the update.
    """

    kind: str
    path: str | None
    subgroup: int
    start: float
    end: float


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals: time during which any was running.

    Args:
      intervals: the intervals, in any order; they may overlap.

    Returns:
      Seconds covered by at least one interval.
    """
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


_NO_PLACEMENT: Mapping[str, int] = MappingProxyType({})

BYTES = {"read": "bytes_read", "write": "bytes_written"}
"""Per transfer kind, the field of :class:`UpdateStats` that counts its bytes on each path."""
BUSY = {"read": "read_busy_s", "write": "write_busy_s"}
"""Per transfer kind, the name of the seconds a path spent on it (:meth:`UpdateStats.busy_s`)."""
PER_PATH = (*BYTES.values(), *BUSY.values(), "placement")
"""The figures :meth:`UpdateStats.as_dict` gives per path, keyed ``<name>[<path>]``: every ``log_to`` line has them."""
LOG_REQUIRED = ("step", "seconds", "read_wait_s", "compute_s", "write_wait_s", "cache_hits", "cache_misses", "paths")
"""The other keys of a ``log_to`` line (:func:`log_line`) that reading it back (``jax-mlp report``) needs."""


class UpdateStats(NamedTuple):
    """Statistics of one ``update`` (or of ``init``, at step 0).

    Attributes:
      step: the step the update produced.
      seconds: wall time of the whole call.
      read_wait_s: time the pipeline waited for records to arrive.
      compute_s: time spent dispatching the jitted inner updates; dispatch is asynchronous, so the
        device time mostly shows in ``write_wait_s``, where writer threads wait for the results.
      write_wait_s: time the pipeline waited for records to be stored.
      bytes_read: bytes read from each path, keyed by path.
      bytes_written: bytes written to each path, keyed by path.
      cache_hits: subgroups served by the host cache.
      cache_misses: subgroups read from a path.
      compiles: XLA compilations this call triggered.
      total_compiles: XLA compilations all calls of this offloader triggered so far.
      events: every record read and write, and every subgroup's compute, that counts towards this
        call, as :class:`IOEvent` s timed from its start.
      placement: how many subgroups have their newest stored record on each path, keyed by path.
      bandwidth: the scheduler's estimate of each path's bandwidth after this call, keyed by path,
        as ``{"read": bytes/s, "write": bytes/s}``: declared, probed, or measured while running.
      moves: subgroups the scheduler moved to another path after this call (each is written there
        by the next update).
      fallback: whether the scheduler has put every subgroup on the fastest path and stopped
        rebalancing, because the paths together were slower than it alone would be.
      check_s: of an init, the seconds the optimizer check took (see :mod:`jax_mlp._src.plan.optimizer_check`).
      whole_leaf_subgroups: of an init, each leaf kept whole although its state exceeds
        ``subgroup_size`` (its optimizer mixes its rows), keyed by leaf path, with its subgroup's index.
      transfer: the path subgroups took between host and device, ``"pinned"`` or ``"plain"``
        (see :mod:`jax_mlp._src.stream.transfer`).
      overlapped: of an update that overlapped the backward pass (``offload.overlap``), the subgroups
        whose update started from the grads the backward handed over, before ``update`` was called.
      overlap_s: of such an update, the seconds it streamed before ``update`` was called; ``seconds``
        counts them too.
      overlap_bytes: the most host bytes of handed-over grads (and params) held at once.
      rolled_back: whether the grads ``update`` was given differed from those the backward handed over
        (a clipping that fired, say), so the overlapped update was undone and the step streamed again.
      overlap_fallback: whether the last trial of both modes found the split step faster, so steps run
        split (the backward's grads let go) until the next trial (see
        :mod:`jax_mlp._src.schedule.overlap_choice`).
      overlapped_step_s: the median overlapped step (``update`` to ``update``) of that trial; 0 before one.
      split_step_s: the median split step of that trial; 0 before one.
    """

    step: int
    seconds: float
    read_wait_s: float
    compute_s: float
    write_wait_s: float
    bytes_read: dict[str, int]
    bytes_written: dict[str, int]
    cache_hits: int
    cache_misses: int
    compiles: int
    total_compiles: int
    events: tuple[IOEvent, ...] = ()
    placement: Mapping[str, int] = _NO_PLACEMENT
    bandwidth: Mapping[str, Mapping[str, float]] = MappingProxyType({})
    moves: int = 0
    fallback: bool = False
    check_s: float = 0.0
    whole_leaf_subgroups: Mapping[str, int] = _NO_PLACEMENT
    transfer: str = "plain"
    overlapped: int = 0
    overlap_s: float = 0.0
    overlap_bytes: int = 0
    rolled_back: bool = False
    overlap_fallback: bool = False
    overlapped_step_s: float = 0.0
    split_step_s: float = 0.0

    @property
    def paths(self) -> list[str]:
        """The storage paths, in the order of the ``paths`` option."""
        return list(self.bytes_read)

    def busy_s(self, kind: str, path: str) -> float:
        """Seconds during which ``path`` was doing at least one transfer of ``kind`` (read or write)."""
        return busy_seconds((e.start, e.end) for e in self.events if e.kind == kind and e.path == path)

    def _per_path(self, path: str) -> dict[str, float]:
        """The figures of one path, by the names of :data:`PER_PATH`."""
        moved = {name: getattr(self, name)[path] for name in BYTES.values()}
        busy = {name: self.busy_s(kind, path) for kind, name in BUSY.items()}
        return {**moved, **busy, "placement": self.placement.get(path, 0)}

    def as_dict(self) -> dict[str, Any]:
        """A flat dict of numbers, ready for a metrics logger, with ``bytes_read[<path>]`` style keys for per-path figures.

        Returns:
          The numeric scalar fields and ``pinned_transfer`` (1 where subgroups took the pinned path), then per path: ``bytes_read``, ``bytes_written``, ``read_busy_s`` and
          ``write_busy_s`` (seconds the path spent reading or writing) and ``placement`` (subgroups
          stored there); then ``whole_leaf_subgroups[<leaf>]`` for each leaf kept whole.
        """
        flat: dict[str, Any] = {k: v for k, v in self._asdict().items() if not isinstance(v, (Mapping, tuple, str))}
        flat["pinned_transfer"] = int(self.transfer == "pinned")
        for path in self.paths:
            flat.update({f"{name}[{path}]": value for name, value in self._per_path(path).items()})
        for leaf, subgroup in self.whole_leaf_subgroups.items():
            flat[f"whole_leaf_subgroups[{leaf}]"] = subgroup
        return flat

    def summary(self) -> str:
        """A few readable lines: where the time went, then bytes, throughput and placement per path."""
        lines = [
            f"step {self.step}: {self.seconds * 1e3:.1f} ms (waiting on reads {self.read_wait_s * 1e3:.1f} ms, "
            f"computing {self.compute_s * 1e3:.1f} ms, waiting on writes {self.write_wait_s * 1e3:.1f} ms); "
            f"cache {self.cache_hits} hits, {self.cache_misses} misses; "
            f"{self.compiles} compilations ({self.total_compiles} so far)"
        ]
        width = max(len(path) for path in self.paths)
        lines.append(f"  {'path':<{width}}  {'read':>10}  {'written':>10}  {'read/s':>10}  {'write/s':>10}  subgroups")
        for path in self.paths:
            rates = [
                format_bytes(nbytes / busy) + "/s" if busy > 0 else "-"
                for nbytes, busy in (
                    (self.bytes_read[path], self.busy_s("read", path)),
                    (self.bytes_written[path], self.busy_s("write", path)),
                )
            ]
            lines.append(
                f"  {path:<{width}}  {format_bytes(self.bytes_read[path]):>10}  "
                f"{format_bytes(self.bytes_written[path]):>10}  {rates[0]:>10}  {rates[1]:>10}  "
                f"{self.placement.get(path, 0):>9}"
            )
        return "\n".join(lines)


class IOCounters:
    """Thread-safe tallies of one call since the last ``reset``: bytes per path, cache hits, timed events.

    Reader, writer and compute threads hand it what they did (the tier stack's transfers, duck-typed
    as ``(kind, path index, subgroup, nbytes, start, end)``); it calls nothing.

    Args:
      paths: the paths' names, in index order.
    """

    def __init__(self, paths: list[str]):
        self._paths = paths
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.bytes_read = dict.fromkeys(self._paths, 0)
            self.bytes_written = dict.fromkeys(self._paths, 0)
            self.cache_hits = 0
            self.cache_misses = 0
            self._events: list[IOEvent] = []

    def count(self, io: Any) -> None:
        """Counts one record read or written (a :class:`~jax_mlp._src.storage.tier_stack.RecordIO`)."""
        path = self._paths[io.path]
        event = IOEvent(io.kind, path, io.subgroup, io.start, io.end)
        with self._lock:
            if io.kind == "read":
                self.bytes_read[path] += io.nbytes
                self.cache_misses += 1
            else:
                self.bytes_written[path] += io.nbytes
            self._events.append(event)

    def hit(self) -> None:
        """Counts a subgroup the host cache served."""
        with self._lock:
            self.cache_hits += 1

    def computed(self, subgroup: int, started: float) -> None:
        """Records that ``subgroup``'s program was dispatched from ``started`` (``time.perf_counter()``) until now."""
        event = IOEvent("compute", None, subgroup, started, time.perf_counter())
        with self._lock:
            self._events.append(event)

    def events_since(self, origin: float) -> tuple[IOEvent, ...]:
        """The events so far, timed relative to ``origin`` (a ``time.perf_counter()``), by start time."""
        with self._lock:
            events = list(self._events)
        shifted = (e._replace(start=e.start - origin, end=e.end - origin) for e in events)
        return tuple(sorted(shifted, key=lambda e: e.start))


def update_stats(
    step: int,
    timings: Any,
    extra_wait: float,
    counters: IOCounters,
    compiles: int,
    total_compiles: int,
    locations: Mapping[int, int],
    paths: Sequence[str],
    speeds: Sequence[Any],
    moves: int = 0,
    fallback: bool = False,
    ended: float | None = None,
) -> UpdateStats:
    """The stats of one call, from what its pipeline run and its counters measured.

    Args:
      step: the step the call produced.
      timings: the pipeline run's :class:`~jax_mlp._src.stream.engine.Timings`.
      extra_wait: seconds waited before the run for the previous call's idle-time writes.
      counters: the call's counters (read before they are reset).
      compiles: XLA compilations of this call; ``total_compiles`` of all calls so far.
      locations: the path index of each subgroup's newest stored record.
      paths: the paths' names, in index order.
      speeds: the scheduler's :class:`~jax_mlp._src.schedule.performance.PathSpeed` per path.
      moves: subgroups the scheduler moved after this call.
      fallback: whether the scheduler has fallen back to the fastest path alone.
      ended: the ``time.perf_counter()`` at which the call's pipeline ended (default: now), the
        origin of its events with ``timings``: what ran since (the scheduler) is not the update's.
    """
    started = (time.perf_counter() if ended is None else ended) - timings.total - extra_wait
    stored = collections.Counter(locations.values())
    return UpdateStats(
        step=step,
        seconds=timings.total + extra_wait,
        read_wait_s=timings.read_wait,
        compute_s=timings.compute,
        write_wait_s=timings.write_wait + extra_wait,
        bytes_read=dict(counters.bytes_read),
        bytes_written=dict(counters.bytes_written),
        cache_hits=counters.cache_hits,
        cache_misses=counters.cache_misses,
        compiles=compiles,
        total_compiles=total_compiles,
        events=counters.events_since(started),
        placement={path: stored[i] for i, path in enumerate(paths)},
        bandwidth={
            path: {"read": speed.read_bandwidth, "write": speed.write_bandwidth}
            for path, speed in zip(paths, speeds, strict=True)
        },
        moves=moves,
        fallback=fallback,
    )


def log_line(stats: UpdateStats) -> dict[str, Any]:
    """The JSON object ``log_to`` writes for one ``init`` or ``update``.

    Args:
      stats: the call's statistics.

    Returns:
      ``stats.as_dict()``, plus ``time`` (Unix time of the line), ``paths`` (the paths, in order),
      ``bandwidth`` (the scheduler's estimate per path, which the report draws throughput against)
      and ``events``: one ``[kind, path index or null, subgroup, start_s, end_s]`` per
      :class:`IOEvent`, times relative to the start of the call.
    """
    paths = stats.paths
    index = {path: i for i, path in enumerate(paths)}
    line = stats.as_dict()
    line["time"] = time.time()
    line["paths"] = paths
    line["bandwidth"] = {path: dict(speeds) for path, speeds in stats.bandwidth.items()}
    line["events"] = [[e.kind, index.get(e.path), e.subgroup, round(e.start, 6), round(e.end, 6)] for e in stats.events]
    return line


class StatsLog:
    """Appends one JSON line per ``init`` and ``update`` to a file: the ``log_to`` option of ``mlp_offload``.

    The file is opened, appended to and closed for every line, so it is complete after each update
    and can be read (or plotted with ``jax-mlp report``) while training runs.

    Args:
      path: the file to write.
      append: keep the lines already in the file (a resumed run); otherwise the file starts empty.

    Raises:
      OffloadError: if the file cannot be created or written.
    """

    def __init__(self, path: str | os.PathLike, *, append: bool = False):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"log_to must be a file name, got {type(path).__name__}")
        self.path = os.path.abspath(os.path.expanduser(os.fspath(path)))
        try:
            with open(self.path, "a" if append else "w", encoding="utf-8"):
                pass
        except OSError as error:
            raise OffloadError(
                f"log_to={self.path!r} cannot be written ({error.strerror}): give a file in a writable directory, "
                "or log_to=None"
            ) from error

    def __call__(self, stats: UpdateStats) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(log_line(stats)) + "\n")


def fan_out(*callbacks: Callable[[UpdateStats], None] | None) -> Callable[[UpdateStats], None] | None:
    """One ``on_stats`` callback that calls each given one; None if none is given.

    Every callback runs even if an earlier one raises; the first exception is then re-raised.
    """
    given = [c for c in callbacks if c is not None]
    if len(given) <= 1:
        return given[0] if given else None

    def call_each(stats: UpdateStats) -> None:
        errors = []
        for callback in given:
            try:
                callback(stats)
            except Exception as error:
                errors.append(error)
        if errors:
            raise errors[0]

    return call_each


def stats_callback(
    on_stats: Callable[[UpdateStats], None] | None, log_to: str | os.PathLike | None, *, resume: bool
) -> Callable[[UpdateStats], None] | None:
    """The user's ``on_stats``, and with ``log_to`` a :class:`StatsLog` of that file beside it (appended to on a
    resume, emptied first otherwise)."""
    return on_stats if log_to is None else fan_out(StatsLog(log_to, append=resume), on_stats)
