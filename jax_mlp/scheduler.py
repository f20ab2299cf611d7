"""The policy: the order subgroups are updated in, which path holds each one, and when to move them.

* **Order.** ``"alternate"`` runs ascending on even steps and descending on odd ones, so the
  subgroups updated last in one step are still in the host cache when the next step starts with
  them. ``"ascending"`` is the baseline.
* **Placement.** Subgroups are spread over the paths in the shares of :func:`model.best_split`,
  interleaved in update order (a smooth weighted round robin by bytes), so consecutive reads hit
  different paths at once. ``"round_robin"`` splits them equally, like a fixed ratio.
* **Rebalancing.** After each update every path reports its bytes and busy time per direction
  (:class:`~jax_mlp.storage.traffic.Usage`). :class:`PathEstimate` fits each direction's rate and
  the burst a throttle lets through after idle time to the last updates, with medians, so one odd
  update does not move it and a lightly loaded path does not look fast; and it keeps how far the
  two directions get in each other's way. A path has changed (another job, a new cap) when two
  updates in a row move a load 1.5× outside all the window saw for that load; then its window
  starts again. From these the scheduler predicts the next updates: the records the host cache
  serves are not read, and a moved record is still read from its old path in the update that
  moves it. Until every rate is fitted across
  loads, a move goes halfway to the split it computes. It moves subgroups only when the
  predicted gain is above a tenth of the update and above the extra time of the moving update, and
  a moved subgroup stays put for a few updates, so the placement settles instead of swinging.
  Records never go back the way others came (from the path they were moved to, to the one they
  left) until some path's measurements change: a throttle lets a lightly loaded path look faster
  than it is (it lets a burst through after each pause), so the path that gave records away looks
  fast and would get them back, update after update. Moves are on trial: if the two settled
  updates after them measure more than a tenth slower than the ones before, they are undone, and
  nothing moves until a path changes. A moved subgroup is written to its new path at its next
  write-back, which happens every step anyway: a move costs no extra bytes.
* **Fallback.** Once the placement has settled, if the measured updates are slower than the model
  predicts for the fastest path alone (paths that interfere, a model that misses something), every
  subgroup moves to that path and rebalancing stops: multi-path is never worse than one path.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Callable, Sequence
from typing import NamedTuple

from jax_mlp import model
from jax_mlp.model import PathSpeed
from jax_mlp.storage.traffic import Usage

WINDOW = 8
"""Updates whose measurements a path's estimate is fitted to."""
MIN_SAMPLES = 3
"""Measurements of each direction a path needs before the split follows them."""
MIN_GAIN = 0.10
"""Fraction of the predicted update a new placement must save before subgroups move."""
HOLD = 4
"""Updates a moved subgroup stays on the path it was moved to."""
DISTINCT_LOADS = 0.2
"""How much two updates' bytes on a path must differ for the pair to tell its rate from its burst."""
CHANGE = 1.5
"""How far outside the times the window saw for the same load an update must be, twice in a row in the same
sense, to count as a change of the path."""
SIGNIFICANT = 0.5
"""Of the update's longest busy time, what a direction must take (measured or predicted) for its surprise to count."""
_ROUNDINGS = (round, math.floor, math.ceil)


class Measured(NamedTuple):
    """One update as the step measured it: its wall time, and the part of it spent waiting on I/O."""

    seconds: float
    io_wait: float


class Trial(NamedTuple):
    """Moves on trial: the placement and shares before them, and the measured update (the median of the
    settled ones before them) they have to beat."""

    previous: list[int]
    shares: tuple[float, ...]
    before: float


def weighted_interleave(record_bytes: Sequence[int], shares: Sequence[float]) -> list[int]:
    """Assigns records to paths in proportion to ``shares`` of bytes, interleaved in index order."""
    credit = [0.0] * len(shares)
    placement = []
    for nbytes in record_bytes:
        for index, share in enumerate(shares):
            credit[index] += share * nbytes
        chosen = max(range(len(shares)), key=lambda i: credit[i])
        credit[chosen] -= nbytes
        placement.append(chosen)
    return placement


def shift_placement(
    placement: Sequence[int],
    record_bytes: Sequence[int],
    shares: Sequence[float],
    movable: Sequence[bool] | None = None,
    rounding: Callable[[float], int] = round,
) -> list[int]:
    """Moves as few records as it takes to reach ``shares``, spread evenly along the update order.

    Only records whose ``movable`` is true move (all, by default). ``rounding`` turns the records a
    path holds too many into a whole count.
    """
    placement = list(placement)
    movable = movable or [True] * len(placement)
    total = sum(record_bytes)
    deficit = [share * total for share in shares]
    for index, nbytes in zip(placement, record_bytes, strict=True):
        deficit[index] -= nbytes
    for source in range(len(shares)):
        mine = [k for k, p in enumerate(placement) if p == source and movable[k]]
        if deficit[source] >= 0 or not mine:
            continue
        count = min(len(mine), rounding(-deficit[source] / (sum(record_bytes[k] for k in mine) / len(mine))))
        for j in range(count):
            subgroup = mine[int((j + 0.5) * len(mine) / count)]
            target = max(range(len(shares)), key=lambda i: deficit[i])
            if deficit[target] <= 0:
                break
            placement[subgroup] = target
            deficit[target] -= record_bytes[subgroup]
            deficit[source] += record_bytes[subgroup]
    return placement


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
        for kind, nbytes, busy in _directions(usage):
            window = list(self.samples[kind])[: -1 if _far(self.off[kind]) >= CHANGE else None]  # not a change's first
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
        for kind, nbytes, busy in _directions(usage):
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
        again = _far(before) >= CHANGE and _far(off) >= CHANGE and (before - 1) * (off - 1) > 0
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

    def measured(self, kind: str) -> bool:
        """Whether ``kind`` (read or write) has enough measurements to be trusted: one since a change."""
        return len(self.samples[kind]) >= (1 if self.since_change[kind] else MIN_SAMPLES)

    def fitted(self, kind: str) -> bool:
        """Whether ``kind``'s loads have differed enough, now or before, to tell its rate from its burst."""
        return self.credit[kind] is not None

    @property
    def speed(self) -> PathSpeed:
        """The estimate: each measured direction's fitted rate and burst, else the starting ones."""
        start = self.start
        read = _fit(self.samples["read"], self.credit["read"] or 0.0) or (start.read_bandwidth, start.read_burst)
        write = _fit(self.samples["write"], self.credit["write"] or 0.0) or (start.write_bandwidth, start.write_burst)
        serial = statistics.median(self.serial) if self.serial else start.serial
        return PathSpeed(start.name, read[0], write[0], serial, read[1], write[1])


def _directions(usage: Usage) -> tuple[tuple[str, int, float], ...]:
    """``(kind, bytes, busy seconds)`` of the read and the write direction of ``usage``."""
    return ("read", usage.bytes_read, usage.read_busy_seconds), ("write", usage.bytes_written, usage.write_busy_seconds)


def _outside(value: float, seen: Sequence[float]) -> float:
    """``value`` over the largest of ``seen`` if above it, over the smallest if below it, else 1."""
    return value / max(seen) if value > max(seen) else value / min(seen) if value < min(seen) else 1.0


def _distinct(a: float, b: float) -> bool:
    """Whether two loads (bytes) differ by more than ``DISTINCT_LOADS`` of the larger."""
    return abs(a - b) > DISTINCT_LOADS * max(a, b)


def _far(ratio: float) -> float:
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


class Loads:
    """The bytes each record adds to its path during an update, averaged over the next two steps' orders.

    Args:
      read: bytes each record is read for during an update (0 when the host cache serves it).
      write: bytes each record is written for during an update (0 when written back in idle time).
    """

    def __init__(self, read: Sequence[float], write: Sequence[float]):
        self.read, self.write = list(read), list(write)

    def seconds(self, speeds: Sequence[PathSpeed], read_from: Sequence[int], write_to: Sequence[int]) -> float:
        """The slowest path's busy time, records read from ``read_from`` and written to ``write_to``."""
        read, write = [0.0] * len(speeds), [0.0] * len(speeds)
        for k, (source, target) in enumerate(zip(read_from, write_to, strict=True)):
            read[source] += self.read[k]
            write[target] += self.write[k]
        return max(speed.seconds(r, w) for speed, r, w in zip(speeds, read, write, strict=True))

    def shares(self, speeds: Sequence[PathSpeed]) -> tuple[float, ...]:
        """Shares of the records per path that make all paths finish together.

        Found by bisection on the common finishing time, since a burst makes a path's time
        not proportional to its share.
        """
        read, write = sum(self.read), sum(self.write)

        def share_within(speed: PathSpeed, seconds: float) -> float:
            low, high = 0.0, 1.0
            for _ in range(40):
                middle = (low + high) / 2
                low, high = (middle, high) if speed.seconds(middle * read, middle * write) <= seconds else (low, middle)
            return low

        low, high = 0.0, min(speed.seconds(read, write) for speed in speeds)
        for _ in range(40):
            middle = (low + high) / 2
            low, high = (low, middle) if sum(share_within(s, middle) for s in speeds) >= 1 else (middle, high)
        shares = [share_within(speed, high) for speed in speeds]
        return tuple(share / sum(shares) for share in shares)


class Scheduler:
    """Order, placement and rebalancing for one plan.

    Args:
      record_bytes: the size of each subgroup's record.
      speeds: the starting estimate of each path's bandwidths.
      order: ``"alternate"`` or ``"ascending"``.
      placement: ``"bandwidth"`` (split by the model, rebalanced) or ``"round_robin"`` (equal, fixed).
      rebalance: whether the split follows measured throughput.
    """

    def __init__(
        self,
        record_bytes: Sequence[int],
        speeds: Sequence[PathSpeed],
        *,
        order: str = "alternate",
        placement: str = "bandwidth",
        rebalance: bool = True,
    ):
        self.record_bytes = list(record_bytes)
        self.estimates = [PathEstimate(speed) for speed in speeds]
        self.order_kind = order
        self.balanced = placement == "bandwidth"
        self.rebalance = rebalance and self.balanced
        self.shares = model.best_split(speeds) if self.balanced else tuple(1 / len(speeds) for _ in speeds)
        self.placement = weighted_interleave(self.record_bytes, self.shares)
        self.moves = 0
        self.last_moves = 0
        self.updates = 0
        self.fallback = False
        self._moved_at = [-HOLD] * len(self.record_bytes)
        self._flows: set[tuple[int, int]] = set()  # (from, to) paths records moved along since the last change
        self._trial: Trial | None = None
        self._settled: collections.deque[Measured] = collections.deque(maxlen=WINDOW)

    @property
    def speeds(self) -> list[PathSpeed]:
        """Each path's current estimate."""
        return [estimate.speed for estimate in self.estimates]

    def order(self, step: int) -> list[int]:
        """The order in which step ``step`` updates the subgroups."""
        ascending = list(range(len(self.record_bytes)))
        return ascending[::-1] if self.order_kind == "alternate" and step % 2 else ascending

    def loads(self, cache_bytes: int) -> Loads:
        """What each record adds to its path's busy time in an update, with a host cache of ``cache_bytes``.

        In each step's order the records that fit in the cache are the ones the previous step
        updated last: with the alternating order they are its first, served from the cache; with
        the ascending order they are evicted before they are reached. Records evicted during the
        update (all but the last that fit) are written during it; the rest in the idle time after.
        """
        read, write = [0.0] * len(self.record_bytes), [0.0] * len(self.record_bytes)
        for step in (0, 1):
            order = self.order(step)
            cached = _fitting(order, self.record_bytes, cache_bytes)
            if cached == len(order):
                continue
            for k in order[cached if self.order_kind == "alternate" else 0 :]:
                read[k] += self.record_bytes[k] / 2
            for k in order[: len(order) - cached]:
                write[k] += self.record_bytes[k] / 2
        return Loads(read, write)

    def observe(self, usages: Sequence[Usage], cache_bytes: int = 0, measured: Measured | None = None) -> None:
        """Learns from what each path moved since the last call, and moves subgroups if that pays.

        Args:
          usages: each path's usage since the last call, in path order.
          cache_bytes: the host cache, whose records the next updates do not read.
          measured: the update's wall time and I/O wait, which the fallback compares with one path.
        """
        offs = [estimate.surprise(usage) for estimate, usage in zip(self.estimates, usages, strict=True)]
        for estimate, usage, off in zip(self.estimates, usages, _local(_significant(offs, usages)), strict=True):
            estimate.add(usage, off)
        self.updates += 1
        self.last_moves = 0
        loads = self.loads(cache_bytes)
        changed = any(estimate.changed for estimate in self.estimates)
        if changed:
            self._settled.clear()
            self._flows.clear()
        if not self.rebalance or not self._measured(loads):
            return
        if measured is not None and not changed and self.updates - max(self._moved_at) > 1:  # not a moving update
            self._settled.append(measured)
        if self._trial is not None and self._judge(self._trial):
            return
        speeds = self.speeds
        shares = loads.shares(speeds)
        if not changed and not self._fitted(loads):  # rates inflated by bursts: go halfway, varying the loads
            held = self.held_shares()
            shares = tuple((a + b) / 2 for a, b in zip(held, shares, strict=True))
        movable = [changed or self.updates - moved >= HOLD for moved in self._moved_at]
        placement = min(  # whole records: the split's count rounded either way, whichever predicts faster
            (
                self._without_reversals(shift_placement(self.placement, self.record_bytes, shares, movable, rounding))
                for rounding in _ROUNDINGS
            ),
            key=lambda candidate: loads.seconds(speeds, candidate, candidate),
        )
        now = loads.seconds(speeds, self.placement, self.placement)
        gain = now - loads.seconds(speeds, placement, placement)
        moving = loads.seconds(speeds, self.placement, placement) - now  # reads still from the old paths
        if gain > MIN_GAIN * now and gain > moving:
            if changed:  # the updates before a change say nothing of the split after it
                self._trial = None
            elif self._trial is None and self._settled:  # moves in a row are judged together, against the first's
                self._trial = Trial(self.placement, self.shares, statistics.median(m.seconds for m in self._settled))
            self._move(shares, placement)
        elif len(self._settled) == WINDOW:
            self._fall_back_if_slower(loads, speeds)

    def _fall_back_if_slower(self, loads: Loads, speeds: Sequence[PathSpeed]) -> None:
        """Moves everything to the fastest path if the settled updates took longer than it alone would.

        One path's update is predicted as its I/O time plus the update's time not spent waiting on
        I/O, as if none of them overlapped: an upper bound, so a fallback is never for a small error.
        """
        alone = [
            loads.seconds(speeds, [i] * len(self.placement), [i] * len(self.placement)) for i in range(len(speeds))
        ]
        fastest = min(range(len(speeds)), key=alone.__getitem__)
        seconds = statistics.median(m.seconds for m in self._settled)
        rest = statistics.median(m.seconds - m.io_wait for m in self._settled)
        if seconds > (1 + MIN_GAIN) * (alone[fastest] + rest):
            self._move(tuple(float(i == fastest) for i in range(len(speeds))), [fastest] * len(self.placement))
            self.rebalance, self.fallback = False, True

    def _judge(self, trial: Trial) -> bool:
        """Undoes the moves on trial if the first two settled updates after them were slower than before.

        The model predicted a gain and the measurement says otherwise: the measurement wins. Undoing them
        leaves records moved both ways between the paths, so nothing moves until a path changes.

        Returns:
          Whether it undid them.
        """
        if len(self._settled) < 2:
            return False
        self._trial = None
        if statistics.median(m.seconds for m in self._settled) <= (1 + MIN_GAIN) * trial.before:
            return False
        self._move(trial.shares, trial.previous)
        return True

    def _without_reversals(self, placement: list[int]) -> list[int]:
        """``placement`` with each record kept where it is if moving it would go back the way records came.

        Since the last change no path's estimate moved by more than its noise, so a move back would
        follow the estimates' bias (a lightly loaded throttle looks fast), not the paths.
        """
        return [now if (new, now) in self._flows else new for now, new in zip(self.placement, placement, strict=True)]

    def _move(self, shares: tuple[float, ...], placement: list[int]) -> None:
        """Takes the new placement, noting which subgroups moved, when, and along which paths."""
        moved = [k for k, (a, b) in enumerate(zip(self.placement, placement, strict=True)) if a != b]
        for k in moved:
            self._moved_at[k] = self.updates
            self._flows.add((self.placement[k], placement[k]))
        self.last_moves = len(moved)
        self.moves += len(moved)
        self.shares, self.placement = shares, placement
        self._settled.clear()

    def held_shares(self) -> tuple[float, ...]:
        """Each path's share of the records' bytes in the current placement."""
        held = [0.0] * len(self.estimates)
        for path, nbytes in zip(self.placement, self.record_bytes, strict=True):
            held[path] += nbytes
        return tuple(b / sum(self.record_bytes) for b in held)

    def _fitted(self, loads: Loads) -> bool:
        """Whether every path's rate of each direction the updates use is fitted across loads."""
        kinds = [kind for kind, used in (("read", loads.read), ("write", loads.write)) if any(used)]
        return all(estimate.fitted(kind) for estimate in self.estimates for kind in kinds)

    def _measured(self, loads: Loads) -> bool:
        """Whether every path has enough measurements of each direction the updates use."""
        kinds = [kind for kind, used in (("read", loads.read), ("write", loads.write)) if any(used)]
        return bool(kinds) and all(estimate.measured(kind) for estimate in self.estimates for kind in kinds)


def _significant(offs: Sequence[dict[str, float]], usages: Sequence[Usage]) -> list[dict[str, float]]:
    """Each path's surprises, without those of directions too lightly loaded to matter.

    A throttle lets a lightly loaded path through in bursts (a slice of its rate after each pause),
    so its busy time swings several times either way from one update to the next. A direction that
    took under ``SIGNIFICANT`` of the longest busy time of the update, and would have under it at
    the edge of what it did before (its time over its surprise), does not decide it: its surprise
    counts as none.
    """
    busy = [{kind: seconds for kind, _, seconds in _directions(usage)} for usage in usages]
    longest = max((seconds for directions in busy for seconds in directions.values()), default=0.0)
    return [
        {
            kind: ratio if max(mine[kind], mine[kind] / ratio) >= SIGNIFICANT * longest else 1.0
            for kind, ratio in off.items()
        }
        for off, mine in zip(offs, busy, strict=True)
    ]


def _local(offs: Sequence[dict[str, float]]) -> list[dict[str, float]]:
    """Each path's surprises, without those every path shares: all paths off together is the machine, not a path.

    A direction counts as off only if no other path is off in the same sense by ``CHANGE`` or more.
    """
    local = []
    for i, off in enumerate(offs):
        others = [other for j, other in enumerate(offs) if j != i]
        local.append(
            {
                kind: 1.0 if any(_far(o[kind]) >= CHANGE and (o[kind] - 1) * (ratio - 1) > 0 for o in others) else ratio
                for kind, ratio in off.items()
            }
        )
    return local


def _fitting(order: Sequence[int], record_bytes: Sequence[int], cache_bytes: int) -> int:
    """How many of the first records of ``order`` fit in ``cache_bytes`` together."""
    total = 0
    for count, k in enumerate(order):
        total += record_bytes[k]
        if total > cache_bytes:
            return count
    return len(order)
