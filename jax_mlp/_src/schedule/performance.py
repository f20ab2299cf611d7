"""The performance model of one update: bytes each path moves, the best split over paths, the time.

One update's critical path, for ``N`` records of ``r`` bytes and a cache of ``C`` records:

* alternating order: the first ``C`` subgroups of a step are the last of the previous one, still
  cached; ``N - C`` records are read and ``N - C`` dirty records are evicted (written) during the
  update, and the ``C`` left in the cache are written back in the idle time that follows;
* ascending order: an LRU cache smaller than the state never hits: ``N`` reads, ``N - C`` writes.

A path moves its share in ``time_i = max(r, w) + serial_i * min(r, w)`` with ``r = read_i / read_bw_i``
and ``w = write_i / write_bw_i``: ``serial = 1`` is one pipe shared by both directions (the default, and
what the library's caps emulate), ``serial = 0`` a full-duplex device (a kernel throttle per direction,
a network link to a PFS). The update takes the slowest path's time (or the compute time, if larger) plus the pipeline's fill.
The scheduler splits subgroups with :func:`best_split`, so the plan and the run agree. Each path
starts at the bandwidths it declares, or that the probe measures (:func:`starting_speed`), and the
scheduler corrects them with what it measures while running.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from jax_mlp._src.config import Path
from jax_mlp._src.storage.bandwidth import ProbeResult, probe

DEFAULT_BANDWIDTH = 1e9
"""Bytes/s assumed for a path with nothing declared, probed or capped: measurement corrects it."""
INIT_PROBE_BYTES = 64 * 1024**2
"""Bytes the probe moves on each path at ``init`` when asked to (the ``probe`` option)."""


class PathSpeed(NamedTuple):
    """A path's bandwidths in bytes/s, how much its two directions get in each other's way, and its bursts.

    ``serial`` is 1 for one pipe shared by reads and writes, 0 for a full-duplex device, in between
    for a device that overlaps them in part. ``read_burst`` and ``write_burst`` are the bytes a
    device lets through at once after idle time (a kernel throttle credits a fraction of a second
    of its rate), which an update's busy time does not pay for.
    """

    name: str
    read_bandwidth: float
    write_bandwidth: float
    serial: float = 1.0
    read_burst: float = 0.0
    write_burst: float = 0.0

    def seconds(self, read_bytes: float, write_bytes: float) -> float:
        """Busy time to read ``read_bytes`` and write ``write_bytes`` after idle time, both directions started together."""
        read = max(0.0, read_bytes - self.read_burst) / self.read_bandwidth
        write = max(0.0, write_bytes - self.write_burst) / self.write_bandwidth
        return self.both_ways(read, write)

    def both_ways(self, read_seconds: float, write_seconds: float) -> float:
        """Busy time to read for ``read_seconds`` and write for ``write_seconds`` at once, as ``serial`` allows."""
        return max(read_seconds, write_seconds) + self.serial * min(read_seconds, write_seconds)

    @property
    def seconds_per_byte(self) -> float:
        """Busy time to read and write back one byte, bursts aside."""
        return self._replace(read_burst=0.0, write_burst=0.0).seconds(1, 1)


class Prediction(NamedTuple):
    """What the model predicts for one update.

    ``idle_io_seconds`` is the I/O the update leaves to the idle time around it (the write-back of the
    cache, the first reads ahead): it has to fit in the forward and backward, or the update waits.
    ``fill_seconds`` is the pipeline's fill: the first record's read (unless read ahead) before any
    write can start (``read_fill_seconds``), and the last record's write after its compute
    (``drain_seconds``), each on a path drawn by the shares (the placement interleaves them, so the
    first and last records are no more often on the slowest).
    """

    seconds: float
    shares: tuple[float, ...]
    bytes_read: tuple[float, ...]
    bytes_written: tuple[float, ...]
    path_seconds: tuple[float, ...]
    idle_write_bytes: float
    idle_io_seconds: float = 0.0
    read_fill_seconds: float = 0.0
    drain_seconds: float = 0.0

    @property
    def fill_seconds(self) -> float:
        """The pipeline's fill: the first read and the last write."""
        return self.read_fill_seconds + self.drain_seconds


def best_split(paths: Sequence[PathSpeed]) -> tuple[float, ...]:
    """Shares of the offloaded bytes per path that make all paths finish together."""
    speeds = [1 / p.seconds_per_byte for p in paths]
    total = sum(speeds)
    return tuple(s / total for s in speeds)


def whole_records(shares: Sequence[float], num_records: int) -> tuple[float, ...]:
    """``shares`` as the scheduler can give them: whole records, by largest remainder.

    With few records per path the split is coarse (8 records on paths 2x apart: 5 : 3, not 5.33 : 2.67),
    and the slowest path's whole records bound the update.
    """
    if num_records < 1:
        return tuple(shares)
    counts = [math.floor(share * num_records) for share in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: counts[i] - shares[i] * num_records)
    for i in by_remainder[: max(0, num_records - sum(counts))]:
        counts[i] += 1
    return tuple(count / num_records for count in counts)


def measured_speed(result: ProbeResult) -> PathSpeed:
    """A probe's measurement of a path, as the model's speed of it (its directions' overlap included)."""
    return PathSpeed(result.path, result.read_bandwidth, result.write_bandwidth, result.serial)


def starting_speed(path: Path, run_probe: bool) -> PathSpeed:
    """A path's bandwidths before any update: declared, else probed (if asked), else its caps.

    With none of these, every path starts equal; measurement while running corrects it.

    Args:
      path: the configured path.
      run_probe: whether to measure a bandwidth the path does not declare.

    Returns:
      The path's speed.
    """
    read, write, serial = path.read_bandwidth, path.write_bandwidth, 1.0
    if (read is None or write is None) and run_probe:
        measured = probe(path, total_bytes=INIT_PROBE_BYTES)
        read, write, serial = read or measured.read_bandwidth, write or measured.write_bandwidth, measured.serial
    read = read or path.max_read or write or path.max_write or DEFAULT_BANDWIDTH
    write = write or path.max_write or read
    return PathSpeed(path.name, read, write, serial)


def critical_records(
    num_records: int, cached_records: int, *, alternate: bool, run_on: int = 0, held: bool = False
) -> tuple[int, int, int]:
    """Records read and written during one update, and written after it (idle time).

    After it: the cached records' write-back, and the last ``run_on`` records' writes, which run on past
    the update. With the alternating order those are the next update's first after the cached ones, so
    with ``held`` (the idle-time reads ahead, which take them from memory) they are not read either.
    """
    cached = min(cached_records, num_records)
    if cached == num_records:
        return 0, 0, num_records
    behind = min(run_on, num_records - cached)
    reads = num_records - cached - (behind if held else 0) if alternate else num_records
    return reads, num_records - cached - behind, cached + behind


def _sharing(processes_per_node: int, contention: float) -> float:
    """How much longer a path takes for each process when ``processes_per_node`` share it (``contention``
    is the bandwidth kept when they collide without the node lock)."""
    return processes_per_node / (contention if processes_per_node > 1 else 1.0)


def predict(
    paths: Sequence[PathSpeed],
    *,
    num_records: int,
    record_bytes: float,
    cache_bytes: float = 0,
    alternate: bool = True,
    shares: Sequence[float] | None = None,
    compute_seconds: float = 0.0,
    idle_seconds: float = math.inf,
    processes_per_node: int = 1,
    contention: float = 1.0,
    prefetch_records: int = 0,
    write_back: bool = True,
    run_on: int = 0,
) -> Prediction:
    """Predicts one update's time and traffic.

    The update takes the slowest path's own I/O (or the compute, if longer) plus the pipeline's fill, and
    waits first for what the idle time before it did not hide of the step's other I/O (the write-back,
    the writes that ran on, the reads ahead). The fill's last write is one of those writes: where they
    spill into the next update, it is among them, not on top (with a batch of 8 on two devices, counted
    on top it put `plan` 17-22% above the measured step). The split is in whole records (:func:`whole_records`).

    Args:
      paths: the paths and their bandwidths.
      num_records: subgroups in the plan (per process).
      record_bytes: bytes of one record.
      cache_bytes: the host cache of each process.
      alternate: whether the order alternates (else ascending every step).
      shares: the split over paths (default: :func:`best_split`), rounded to whole records.
      compute_seconds: time the pipeline needs without any I/O wait (all subgroups cached).
      idle_seconds: time between updates (forward and backward) available for write-back.
      processes_per_node: processes of a node that share each path.
      contention: bandwidth kept when several processes hit a path at once with no node lock
        (1.0 with the lock: they take turns at full speed).
      prefetch_records: how many of the update's first reads ran in the idle time before it
        (``prefetch_depth`` with ``idle_prefetch``): they leave its critical path for the idle time.
      write_back: whether the cached records are written back between updates (``flush="idle"``);
        with ``flush="lazy"`` they are written only when evicted.
      run_on: the update's last records whose writes run on past it (``write_depth``), into the idle time.

    Returns:
      The prediction: time, split, and bytes per path per process.
    """
    shares = whole_records(tuple(shares) if shares is not None else best_split(paths), num_records)
    cached = int(cache_bytes // record_bytes) if record_bytes else 0
    reads, writes, behind = critical_records(
        num_records, cached, alternate=alternate, run_on=run_on, held=prefetch_records > 0
    )
    idle = behind if write_back else behind - min(cached, num_records)
    early = min(reads, prefetch_records)
    factor = _sharing(processes_per_node, contention)
    bytes_read = tuple(s * reads * record_bytes for s in shares)
    bytes_written = tuple(s * writes * record_bytes for s in shares)
    path_seconds = tuple(
        factor * p.seconds(s * (reads - early) * record_bytes, w)
        for p, s, w in zip(paths, shares, bytes_written, strict=True)
    )
    idle_seconds_needed = max(
        factor * p.both_ways(s * record_bytes * early / p.read_bandwidth, s * record_bytes * idle / p.write_bandwidth)
        for p, s in zip(paths, shares, strict=True)
    )
    write_fill = (
        sum(s * record_bytes / p.write_bandwidth for p, s in zip(paths, shares, strict=True)) if writes else 0.0
    )
    read_fill = (
        sum(s * record_bytes / p.read_bandwidth for p, s in zip(paths, shares, strict=True))
        if reads and not early
        else 0.0
    )
    spill = max(0.0, idle_seconds_needed - idle_seconds)  # the idle-time I/O the next update waits for
    seconds = max(max(path_seconds), compute_seconds) + read_fill + max(write_fill, spill)
    return Prediction(
        seconds,
        shares,
        bytes_read,
        bytes_written,
        path_seconds,
        idle * record_bytes,
        idle_seconds_needed,
        read_fill_seconds=read_fill,
        drain_seconds=write_fill,
    )


FORWARD_SHARE = 1 / 3
"""Of a step's forward and backward, the forward's share: a backward does about twice its arithmetic. An
update that overlaps the backward starts with it; only idle-time I/O runs during the forward."""


def predict_step(
    paths: Sequence[PathSpeed],
    *,
    forward_backward_seconds: float,
    overlapped: bool,
    num_records: int,
    record_bytes: float,
    **update: Any,
) -> float:
    """One training step's seconds: the forward and backward ``F`` and the update, one after the other or overlapped.

    Split, the step is ``F`` plus the update, whose idle-time I/O has ``F`` to run in (:func:`predict`).
    Overlapped (``offload.overlap``), the update starts with the backward, in the order its grads come,
    and the host cache keeps the records that arrive last: the same bytes move, but the step's I/O ``D``
    (all reads and writes of a step, each path with both directions at once as its ``serial`` allows)
    runs beside the compute. During the forward only the idle-time I/O can run, and no record can be
    written before its subgroup's grads exist: the first subgroup's come ``F_bwd / N`` into the
    backward. So the I/O ends at ``max(F_fwd + D + fill - min(idle, F_fwd), F_fwd + F_bwd / N + W)``, with
    ``W`` the update's own writes on the slowest path, and the step is the larger of that and ``F``,
    plus the last subgroup's compute after its grads arrive. As in :func:`predict`, the last record's
    write drains among the idle-time I/O that did not fit in the forward: only what it outlasts adds.

    Args:
      paths: the paths and their bandwidths.
      forward_backward_seconds: ``F``, the forward and backward of one step.
      overlapped: whether the update overlaps the backward.
      num_records: subgroups in the plan (per process).
      record_bytes: bytes of one record.
      **update: the other arguments of :func:`predict` (cache, shares, compute, processes, ...).

    Returns:
      Seconds.
    """
    one = predict(
        paths, num_records=num_records, record_bytes=record_bytes, idle_seconds=forward_backward_seconds, **update
    )
    if not overlapped:
        return forward_backward_seconds + one.seconds
    factor = _sharing(update.get("processes_per_node", 1), update.get("contention", 1.0))
    idle_writes = [s * one.idle_write_bytes for s in one.shares]
    step_io = max(
        factor * p.seconds(read, written + idle)
        for p, read, written, idle in zip(paths, one.bytes_read, one.bytes_written, idle_writes, strict=True)
    )
    writes = max(factor * p.seconds(0.0, written) for p, written in zip(paths, one.bytes_written, strict=True))
    forward = FORWARD_SHARE * forward_backward_seconds
    first_grads = forward + (forward_backward_seconds - forward) / num_records
    spilled = max(0.0, one.idle_io_seconds - forward)  # idle-time I/O left to run beside the update
    fill = one.read_fill_seconds + max(0.0, one.drain_seconds - spilled)
    io = max(forward + step_io + fill - min(one.idle_io_seconds, forward), first_grads + writes)
    tail = update.get("compute_seconds", 0.0) / num_records
    return max(forward_backward_seconds, io) + tail


class Loads:
    """The bytes each record adds to its path in a step, averaged over the next two steps' orders.

    An update's own reads and writes (``read``, ``write``) are on its critical path; the step's other
    writes (``idle_write``: the cache's write-back, the writes that run on past the update) have the
    ``idle_seconds`` between updates, and what does not fit there delays the next update on its path.
    Every record is written once a step, so with a short forward and backward (a small batch) the
    whole step's bytes decide, not the update's alone.

    Args:
      read: bytes each record is read for during an update (0 when the host cache serves it).
      write: bytes each record is written for during an update (0 when written back in idle time).
      idle_write: bytes each record is written for in the idle time after an update.
      idle_seconds: the time between updates that the idle-time writes have (infinite: all of them fit).
    """

    def __init__(
        self,
        read: Sequence[float],
        write: Sequence[float],
        idle_write: Sequence[float] | None = None,
        idle_seconds: float = math.inf,
    ):
        self.read, self.write = list(read), list(write)
        self.idle_write = list(idle_write) if idle_write is not None else [0.0] * len(self.write)
        self.idle_seconds = idle_seconds

    def seconds(self, speeds: Sequence[PathSpeed], read_from: Sequence[int], write_to: Sequence[int]) -> float:
        """The slowest path's busy time, records read from ``read_from`` and written to ``write_to``."""
        read, write, idle = [0.0] * len(speeds), [0.0] * len(speeds), [0.0] * len(speeds)
        for k, (source, target) in enumerate(zip(read_from, write_to, strict=True)):
            read[source] += self.read[k]
            write[target] += self.write[k]
            idle[target] += self.idle_write[k]
        return max(self._busy(*path) for path in zip(speeds, read, write, idle, strict=True))

    def _busy(self, speed: PathSpeed, read: float, write: float, idle_write: float) -> float:
        """A path's busy time in an update: its own I/O, or the step's less the idle time, whichever is longer."""
        return max(speed.seconds(read, write), speed.seconds(read, write + idle_write) - self.idle_seconds)

    def shares(self, speeds: Sequence[PathSpeed]) -> tuple[float, ...]:
        """Shares of the records per path that make all paths finish together.

        Found by bisection on the common finishing time, since a burst makes a path's time
        not proportional to its share.
        """
        read, write, idle = sum(self.read), sum(self.write), sum(self.idle_write)

        def share_within(speed: PathSpeed, seconds: float) -> float:
            low, high = 0.0, 1.0
            for _ in range(40):
                middle = (low + high) / 2
                busy = self._busy(speed, middle * read, middle * write, middle * idle)
                low, high = (middle, high) if busy <= seconds else (low, middle)
            return low

        low, high = 0.0, min(self._busy(speed, read, write, idle) for speed in speeds)
        for _ in range(40):
            middle = (low + high) / 2
            low, high = (low, middle) if sum(share_within(s, middle) for s in speeds) >= 1 else (middle, high)
        shares = [share_within(speed, high) for speed in speeds]
        return tuple(share / sum(shares) for share in shares)
