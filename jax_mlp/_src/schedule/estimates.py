"""What each path is measured to do: its rate and burst per direction, fitted to its last updates.

A kernel throttle lets a burst through after idle time, so a lightly loaded path looks fast, and the
same load takes one time or several times that as the bursts fall. :class:`PathEstimate` fits each
direction's rate and burst with medians over a window of updates, keeps how far the two directions
get in each other's way, and tells a path that changed (another job, a new cap) from one whose
bursts came or not: two updates in a row that move a load well outside all the window saw for it.
The scheduler (:mod:`~jax_mlp._src.schedule.scheduler`) places subgroups from these estimates.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Sequence

from jax_mlp._src.schedule.performance import PathSpeed
from jax_mlp._src.storage.traffic import Usage

WINDOW = 8
"""Updates whose measurements a path's estimate is fitted to."""
MIN_SAMPLES = 3
"""Measurements of each direction a path needs before the split follows them."""
DISTINCT_LOADS = 0.2
"""How much two updates' bytes on a path must differ for the pair to tell its rate from its burst."""
THROTTLE_SLICE = 0.1
"""Seconds of its rate a kernel throttle lets through at once after idle time: blk-throttle's time slice (cgroup v1's
blkio and v2's io.max). One load cannot tell that burst from the rate: a first guess counts it (:meth:`PathEstimate.speed_assuming`)."""
CHANGE = 1.5
"""How far outside the times the window saw for the same load an update must be, twice in a row in the same
sense, to count as a change of the path."""


class PathEstimate:
    """A path's bandwidth and burst per direction, fitted to its last ``WINDOW`` updates.

    Each update gives, per direction it used, its bytes and busy time. A kernel throttle lets a
    burst through after idle time, so a lightly loaded path looks fast: the rate is fitted as the
    median slope of bytes over busy time between updates of clearly different loads (bytes =
    burst + rate × busy), and never above the median plain rate (bytes over busy time), which a
    burst only makes higher. When the loads have not differed yet, it is that plain rate. Each update that used both directions also
    tells how far they serialised: 0 when the union of their busy times is the longer one (full
    duplex), 1 when it is their sum (one pipe).

    Args:
      start: the declared, probed or assumed speed, used until a direction has been measured.
    """

    def __init__(self, start: PathSpeed):
        self.start = start
        self.samples = {kind: collections.deque(maxlen=WINDOW) for kind in ("read", "write")}
        self.serial: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.off = {"read": 1.0, "write": 1.0}  # the last update's busy time over the estimate's, if off
        self.since_change = {"read": False, "write": False}
        self.credit: dict[str, float | None] = {
            "read": None,
            "write": None,
        }  # the last burst fitted across loads, in seconds of its rate
        self.changed = False

    def surprise(self, usage: Usage) -> dict[str, float]:
        """How far each direction's time per byte in ``usage`` falls outside the range of the window's.

        Compared only with the window's updates of about the same load (within ``DISTINCT_LOADS``), and
        only with their range, not the fit: a throttle lets a lightly loaded path through in bursts
        (a slice of its rate after each pause), so the same load takes one time or several times that,
        as the bursts fall. A path has changed when it moves a load outside all it did before. The
        update that may have begun a change is left out of the range the next one is held to.
        1 within the range, where the direction was idle, or where the window holds fewer than
        ``MIN_SAMPLES`` updates of that load.
        """
        off = {}
        for kind, nbytes, busy in directions(usage):
            window = list(self.samples[kind])[: -1 if far(self.off[kind]) >= CHANGE else None]  # not a change's first
            seen = [t / b for b, t in window if not _distinct(nbytes, b)]
            off[kind] = _outside(busy / nbytes, seen) if nbytes and busy > 0 and len(seen) >= MIN_SAMPLES else 1.0
        return off

    def add(self, usage: Usage, off: dict[str, float] | None = None) -> None:
        """Takes in one update's usage of the path, and whether it changed (see :meth:`_take`).

        Args:
          usage: the path's bytes and busy times of one update.
          off: each direction's :meth:`surprise`, as the scheduler judges it (default: as this path does).
        """
        off = self.surprise(usage) if off is None else off
        self.changed = False
        for kind, nbytes, busy in directions(usage):
            if nbytes and busy > 0:
                self._take(kind, nbytes, busy, off[kind])
        read, write = usage.read_busy_seconds, usage.write_busy_seconds
        if read > 0 and write > 0:
            overlap = (usage.busy_seconds - max(read, write)) / min(read, write)
            self.serial.append(min(1.0, max(0.0, overlap)))

    def _take(self, kind: str, nbytes: int, busy: float, off: float) -> None:
        """Adds one direction's sample; if the path changed, keeps only the samples since.

        A change is a time per byte ``CHANGE`` times outside the window's range, in the same sense twice
        in a row (``off``, see :meth:`surprise`). One update is never enough, however far off: a throttle
        that lets a burst through or not, as the pauses fall, swings one update's time several times
        either way. A change replaces the window, so the split follows the path at once instead of
        waiting for the medians.
        """
        samples = self.samples[kind]
        before = self.off[kind]
        again = far(before) >= CHANGE and far(off) >= CHANGE and (before - 1) * (off - 1) > 0
        if again:
            kept = samples[-1]  # the first update of the change already saw it
            samples.clear()
            samples.append(kept)
            self.since_change[kind] = self.changed = True
            off = 1.0
        self.off[kind] = off
        samples.append((nbytes, busy))
        if _slopes(list(samples)):
            rate, burst = _fit(samples)
            self.credit[kind] = burst / rate

    def _credit(self, kind: str, assumed: float) -> float:
        """The burst last fitted across ``kind``'s loads, in seconds of its rate, else ``assumed``."""
        credit = self.credit[kind]
        return assumed if credit is None else credit

    def measured(self, kind: str) -> bool:
        """Whether ``kind`` (read or write) has enough measurements to be trusted: one since a change."""
        return len(self.samples[kind]) >= (1 if self.since_change[kind] else MIN_SAMPLES)

    def largest(self, kind: str) -> int:
        """The most bytes of ``kind`` (read or write) one update in the window moved: 0 if none."""
        return max((nbytes for nbytes, _ in self.samples[kind]), default=0)

    def fitted(self, kind: str) -> bool:
        """Whether ``kind``'s loads have differed enough, now or before, to tell its rate from its burst."""
        return self.credit[kind] is not None

    @property
    def speed(self) -> PathSpeed:
        """The estimate: each measured direction's fitted rate and burst, else the starting ones."""
        return self.speed_assuming(0.0)

    def speed_assuming(self, credit: float) -> PathSpeed:
        """The estimate, a direction whose loads have not differed yet taken to burst ``credit`` seconds of its rate.

        Args:
          credit: seconds of its rate a direction not :meth:`fitted` lets through after idle time.

        Returns:
          The path's speed, its read and write rates and bursts.
        """
        start = self.start
        read = _fit(self.samples["read"], self._credit("read", credit)) or (start.read_bandwidth, start.read_burst)
        write = _fit(self.samples["write"], self._credit("write", credit)) or (start.write_bandwidth, start.write_burst)
        serial = statistics.median(self.serial) if self.serial else start.serial
        return PathSpeed(start.name, read[0], write[0], serial, read[1], write[1])


def directions(usage: Usage) -> tuple[tuple[str, int, float], ...]:
    """``(kind, bytes, busy seconds)`` of the read and the write direction of ``usage``."""
    return ("read", usage.bytes_read, usage.read_busy_seconds), ("write", usage.bytes_written, usage.write_busy_seconds)


def _outside(value: float, seen: Sequence[float]) -> float:
    """``value`` over the largest of ``seen`` if above it, over the smallest if below it, else 1."""
    return value / max(seen) if value > max(seen) else value / min(seen) if value < min(seen) else 1.0


def _distinct(a: float, b: float) -> bool:
    """Whether two loads (bytes) differ by more than ``DISTINCT_LOADS`` of the larger."""
    return abs(a - b) > DISTINCT_LOADS * max(a, b)


def far(ratio: float) -> float:
    """How far a ratio is from 1, either way."""
    return max(ratio, 1 / ratio)


def _fit(samples: Sequence[tuple[float, float]], credit: float = 0.0) -> tuple[float, float] | None:
    """The rate and burst of ``(bytes, busy seconds)`` samples (see :class:`PathEstimate`); None if none.

    When the loads have not differed, the burst is taken as ``credit`` seconds of the rate, as last
    fitted across loads: a placement that has settled, or a throttle whose rate changed, still lets
    that much through after idle time (a kernel throttle credits a fixed time slice of its rate).
    """
    if not samples:
        return None
    samples = list(samples)
    slopes = _slopes(samples)
    if not slopes:
        rate = statistics.median(nbytes / (busy + credit) for nbytes, busy in samples)
        return rate, rate * credit
    plain = statistics.median(nbytes / busy for nbytes, busy in samples)  # a burst only makes it higher
    rate = min(statistics.median(slopes), plain)
    burst = statistics.median(b - rate * t for b, t in samples)
    return rate, min(max(0.0, burst), min(b for b, _ in samples))


def _slopes(samples: Sequence[tuple[float, float]]) -> list[float]:
    """Bytes over busy time between each two samples whose loads clearly differ."""
    return [
        (b2 - b1) / (t2 - t1)
        for i, (b1, t1) in enumerate(samples)
        for b2, t2 in samples[i + 1 :]
        if _distinct(b1, b2) and (b2 - b1) * (t2 - t1) > 0
    ]
