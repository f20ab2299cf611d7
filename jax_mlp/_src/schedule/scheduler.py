"""The policy: the order subgroups are updated in, which path holds each one, and when to move them.

* **Order.** ``"alternate"`` runs ascending on even steps and descending on odd ones, so the
  subgroups updated last in one step are still in the host cache when the next step starts with
  them. ``"ascending"`` is the baseline.
* **Placement.** Subgroups are spread over the paths in the shares of :func:`~jax_mlp._src.schedule.performance.best_split`,
  interleaved in update order (a smooth weighted round robin by bytes), so consecutive reads hit
  different paths at once. ``"round_robin"`` splits them equally, like a fixed ratio.
* **Rebalancing.** After each update every path reports its bytes and busy time per direction
  (:class:`~jax_mlp._src.storage.traffic.Usage`). :class:`PathEstimate` fits each direction's rate and
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
  An update in which every path was busy for less than a throttle slice moves nothing: all of it
  may have passed in bursts, and tiny loads measure latency, not rates.
  Records never go back the way others came (from the path they were moved to, to the one they
  left) until some path's measurements change: a throttle lets a lightly loaded path look faster
  than it is (it lets a burst through after each pause), so the path that gave records away looks
  fast and would get them back, update after update. Moves are on trial: if the two settled
  updates after them measure more than a tenth slower than the ones before, they are undone, and
  nothing moves until a path changes. A moved subgroup is written to its new path at its next
  write-back, which happens every step anyway: a move costs no extra bytes.
* **Fallback.** Once the placement has settled, if the measured updates take ``FALLBACK`` times what
  the model predicts for the fastest path alone (paths that interfere, a model that misses something),
  every subgroup moves to that path and rebalancing stops: multi-path is never worse than one path.
  Only a path measured at an even split's load or more can be that path: a throttle lets a path that
  holds a few records through in bursts, and its estimate says nothing of the whole load.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Callable, Sequence
from typing import NamedTuple

from jax_mlp._src.schedule.estimates import CHANGE, THROTTLE_SLICE, WINDOW, PathEstimate, directions, far
from jax_mlp._src.schedule.performance import Loads, PathSpeed, best_split
from jax_mlp._src.storage.traffic import Usage

MIN_GAIN = 0.10
"""Fraction of the predicted update a new placement must save before subgroups move."""
HOLD = 4
"""Updates a moved subgroup stays on the path it was moved to."""
SIGNIFICANT = 0.5
"""Of the update's longest busy time, what a direction must take (measured or predicted) for its surprise to count."""
FALLBACK = 1.5
"""How many times the fastest path's predicted update alone the settled updates must take before all moves there.

The model's error on kernel-throttled devices reached 20% either way (``benchmarks/overlap.py --devices real``):
a smaller margin falls back on the model's error, not on paths that get in each other's way."""
_ROUNDINGS = (round, math.floor, math.ceil)


class Measured(NamedTuple):
    """One update as the step measured it: its wall time, the part of it spent waiting on I/O, and the time
    between it and the update before (infinite: not known), which the idle-time writes have."""

    seconds: float
    io_wait: float
    idle: float = math.inf


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


class Scheduler:
    """Order, placement and rebalancing for one plan.

    Args:
      record_bytes: the size of each subgroup's record.
      speeds: the starting estimate of each path's bandwidths.
      order: ``"alternate"`` or ``"ascending"``.
      placement: ``"bandwidth"`` (split by the model, rebalanced) or ``"round_robin"`` (equal, fixed).
      rebalance: whether the split follows measured throughput.
      run_on: each update's last records whose writes run on past it (``write_depth``; none for a
        layer-streamed step, which commits its own).
      held: whether the next update takes those records from memory (the idle-time reads ahead do).
    """

    def __init__(
        self,
        record_bytes: Sequence[int],
        speeds: Sequence[PathSpeed],
        *,
        order: str = "alternate",
        placement: str = "bandwidth",
        rebalance: bool = True,
        run_on: int = 0,
        held: bool = False,
    ):
        self.record_bytes = list(record_bytes)
        self.run_on, self.held = run_on, held
        self.estimates = [PathEstimate(speed) for speed in speeds]
        self.order_kind = order
        self.balanced = placement == "bandwidth"
        self.rebalance = rebalance and self.balanced
        self.shares = best_split(speeds) if self.balanced else tuple(1 / len(speeds) for _ in speeds)
        self.placement = weighted_interleave(self.record_bytes, self.shares)
        self.moves = 0
        self.last_moves = 0
        self.updates = 0
        self.fallback = False
        self._moved_at = [-HOLD] * len(self.record_bytes)
        self._flows: set[tuple[int, int]] = set()  # (from, to) paths records moved along since the last change
        self._trial: Trial | None = None
        self._settled: collections.deque[Measured] = collections.deque(maxlen=WINDOW)
        self._idle: collections.deque[float] = collections.deque(maxlen=WINDOW)  # seconds between updates
        self._followed: tuple[int, ...] | None = None  # the backward's order, once an update overlaps it

    @property
    def speeds(self) -> list[PathSpeed]:
        """Each path's current estimate."""
        return [estimate.speed for estimate in self.estimates]

    def order(self, step: int) -> list[int]:
        """The order in which step ``step`` updates the subgroups: the one :meth:`follow` set, else ``order``'s."""
        if self._followed is not None:
            return list(self._followed)
        ascending = list(range(len(self.record_bytes)))
        return ascending[::-1] if self.order_kind == "alternate" and step % 2 else ascending

    def follow(self, order: Sequence[int] | None) -> None:
        """Every step from now on updates the subgroups in ``order``: the order their grads come in; None: in
        the ``order`` option's again (steps that run split).

        An update that overlaps the backward pass takes each subgroup as its grads arrive, last layer
        first, and the reads of the next update start with its first subgroups. The host cache then
        keeps the last of them (:meth:`cached`): they arrive when the backward ends, and their update
        is the one the step waits for.

        Going from one to the other changes every record's load, as a path's change does: the settled
        updates, a trial and the flows records moved along (:meth:`_without_reversals`) are of the
        other loads, and are forgotten. (The timed overlap's split steps otherwise kept a placement the
        backward's order had made: on paths 6x apart, all on the fast one, 1.10-1.14x the split run.)
        """
        if (order is None) != (self._followed is None):
            self._settled.clear()
            self._flows.clear()
            self._trial = None
        self._followed = None if order is None else tuple(order)

    @property
    def following(self) -> bool:
        """Whether the order is one :meth:`follow` set."""
        return self._followed is not None

    def cached(self, cache_bytes: int) -> frozenset[int] | None:
        """The subgroups whose new records the host cache keeps; None: every one, as its LRU decides.

        With a followed order, the records that fit at its end: a fixed order would have an LRU evict
        each record before the next step reaches it, so the others are written straight to their paths.
        """
        if self._followed is None:
            return None
        count = _fitting(self._followed[::-1], self.record_bytes, cache_bytes)
        return frozenset(self._followed[len(self._followed) - count :])

    def loads(self, cache_bytes: int) -> Loads:
        """What each record adds to its path's busy time in a step, with a host cache of ``cache_bytes``.

        In each step's order the records that fit in the cache are the ones the previous step
        updated last: with the alternating order they are its first, served from the cache; with
        the ascending order they are evicted before they are reached. Records evicted during the
        update (all but the last that fit) are written during it; the rest in the idle time after,
        as are the writes of the ``run_on`` records before them, which run on past the update (and,
        ``held``, the alternating order's next update takes from memory). With a followed order the
        cache keeps its last records (:meth:`cached`); the others are read every step, and written
        during it but the last ``run_on``. The idle-time writes have the time measured between updates
        (:attr:`idle_seconds`).
        """
        read, write, idle = ([0.0] * len(self.record_bytes) for _ in range(3))
        kept = self.cached(cache_bytes)
        if kept is not None:
            written = [k for k in self._followed if k not in kept]
            during = set(written[: max(0, len(written) - self.run_on)])
            for k in written:
                read[k] = float(self.record_bytes[k])
            for k in self._followed:
                (write if k in during else idle)[k] = float(self.record_bytes[k])
            return Loads(read, write, idle, self.idle_seconds)
        for step in (0, 1):
            order = self.order(step)
            cached = _fitting(order, self.record_bytes, cache_bytes)
            during = max(0, len(order) - cached - self.run_on)
            for position, k in enumerate(order):
                (write if position < during else idle)[k] += self.record_bytes[k] / 2
            if cached == len(order):
                continue
            held = self.run_on if self.held else 0
            for k in order[cached + held if self.order_kind == "alternate" else 0 :]:
                read[k] += self.record_bytes[k] / 2
        return Loads(read, write, idle, self.idle_seconds)

    @property
    def idle_seconds(self) -> float:
        """The median time measured between updates, which the idle-time writes have (infinite until measured)."""
        return statistics.median(self._idle) if self._idle else math.inf

    def observe(self, usages: Sequence[Usage], cache_bytes: int = 0, measured: Measured | None = None) -> None:
        """Learns from what each path moved since the last call, and moves subgroups if that pays.

        Args:
          usages: each path's usage since the last call, in path order.
          cache_bytes: the host cache, whose records the next updates do not read.
          measured: the update's wall time and I/O wait, which trials and the fallback compare.
        """
        changed = self._learn(usages)
        if measured is not None and math.isfinite(measured.idle):
            self._idle.append(measured.idle)
        loads = self.loads(cache_bytes)
        if not self.rebalance or not self._measured(loads) or _burst_only(usages):
            return
        if measured is not None and not changed and self.updates - max(self._moved_at) > 1:  # not a moving update
            self._settled.append(measured)
        if self._trial is not None and self._judge(self._trial):
            return
        speeds = self.speeds
        shares, placement = self._proposal(loads, speeds, changed)
        if self._pays(loads, speeds, placement):
            self._put_on_trial(changed)
            self._move(shares, placement)
        elif len(self._settled) == WINDOW:
            self._fall_back_if_slower(loads, speeds)

    def start(self, usages: Sequence[Usage]) -> None:
        """Learns from the init's writes of the whole state, and splits the records as their rates call for.

        The init writes every record the cache does not keep, each path an even share or its declared one:
        each path's write rate at a good part of the whole load, measured before any update. One load
        cannot tell a rate from a throttle's burst (a kernel-throttled path's whole share of a small state
        can pass in one: 12 MiB in 13 ms at 120 MB/s), so each write is taken to have had one
        ``THROTTLE_SLICE`` of its rate free, which a state of a few seconds' writes hardly feels. Writes
        that all took less than a slice may all have been bursts and tell no rate: the split stays. Read
        rates not measured yet are taken in the same ratio to the starting ones. The updates refine the split.
        """
        self._learn(usages)
        if not self.rebalance or not all(estimate.largest("write") for estimate in self.estimates):
            return
        if _burst_only(usages):
            return
        speeds = []
        for estimate in self.estimates:
            start, written = estimate.start, estimate.speed_assuming(THROTTLE_SLICE).write_bandwidth
            speeds.append(
                start._replace(
                    read_bandwidth=start.read_bandwidth * written / start.write_bandwidth, write_bandwidth=written
                )
            )
        shares = best_split(speeds)
        self._move(shares, shift_placement(self.placement, self.record_bytes, shares))
        self._flows.clear()  # measured at an even load, not inside a light path's bursts: nothing to keep from

    def _learn(self, usages: Sequence[Usage]) -> bool:
        """Adds each path's usage to its estimate; a path that changed makes the settled updates and flows moot.

        Returns:
          Whether a path changed.
        """
        offs = [estimate.surprise(usage) for estimate, usage in zip(self.estimates, usages, strict=True)]
        for estimate, usage, off in zip(self.estimates, usages, _local(_significant(offs, usages)), strict=True):
            estimate.add(usage, off)
        self.updates += 1
        self.last_moves = 0
        changed = any(estimate.changed for estimate in self.estimates)
        if changed:
            self._settled.clear()
            self._flows.clear()
        return changed

    def _proposal(
        self, loads: Loads, speeds: Sequence[PathSpeed], changed: bool
    ) -> tuple[tuple[float, ...], list[int]]:
        """The shares the estimates call for, and the placement of whole, movable records closest to them.

        Until the rates are fitted across loads (bursts inflate them), the shares go halfway from the
        held ones, which varies the loads. A record moved fewer than ``HOLD`` updates ago stays, unless
        a path changed; records never go back the way others came (:meth:`_without_reversals`).
        """
        shares = loads.shares(speeds)
        if not changed and not self._fitted(loads):
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
        return shares, placement

    def _pays(self, loads: Loads, speeds: Sequence[PathSpeed], placement: list[int]) -> bool:
        """Whether ``placement`` is predicted to save more than ``MIN_GAIN`` of the update and the moving update's cost.

        The moving update still reads each moved record from its old path.
        """
        now = loads.seconds(speeds, self.placement, self.placement)
        gain = now - loads.seconds(speeds, placement, placement)
        moving = loads.seconds(speeds, self.placement, placement) - now
        return gain > MIN_GAIN * now and gain > moving

    def _put_on_trial(self, changed: bool) -> None:
        """Puts the coming moves on trial against the settled updates before them (moves in a row are judged
        together, against the first's); the updates before a change say nothing of the split after it."""
        if changed:
            self._trial = None
        elif self._trial is None and self._settled:
            self._trial = Trial(self.placement, self.shares, statistics.median(m.seconds for m in self._settled))

    def _fall_back_if_slower(self, loads: Loads, speeds: Sequence[PathSpeed]) -> None:
        """Moves everything to the fastest path if the settled updates took ``FALLBACK`` times what it alone would.

        One path's update is predicted as its I/O time plus the update's time not spent waiting on
        I/O, as if none of them overlapped: an upper bound, so a fallback is never for a small error.
        Only the paths measured at an even split's load or more (:meth:`_carriers`) are predicted alone.
        """
        alone = {
            i: loads.seconds(speeds, [i] * len(self.placement), [i] * len(self.placement))
            for i in self._carriers(loads)
        }
        if not alone:
            return
        fastest = min(alone, key=alone.__getitem__)
        seconds = statistics.median(m.seconds for m in self._settled)
        rest = statistics.median(m.seconds - m.io_wait for m in self._settled)
        if seconds > FALLBACK * (alone[fastest] + rest):
            self._move(tuple(float(i == fastest) for i in range(len(speeds))), [fastest] * len(self.placement))
            self.rebalance, self.fallback = False, True

    def _carriers(self, loads: Loads) -> list[int]:
        """The paths whose window saw them move an even split's share of the update's bytes, in each direction.

        Their estimates predict the whole load from a good part of it; a path that held a few records was
        measured inside a throttle's bursts, which no fit extends to the whole.
        """
        even = {"read": sum(loads.read) / len(self.estimates), "write": sum(loads.write) / len(self.estimates)}
        return [
            i
            for i, estimate in enumerate(self.estimates)
            if all(estimate.largest(kind) >= nbytes for kind, nbytes in even.items())
        ]

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


def _burst_only(usages: Sequence[Usage]) -> bool:
    """Whether every path was busy for less than a throttle slice: all of it may have passed in bursts.

    Such loads bound each rate from below and say nothing of their ratio (two directories on one disk moving
    a few KiB measure request latency and thread wake-ups), so they neither split nor move records.
    """
    return max(usage.busy_seconds for usage in usages) < THROTTLE_SLICE


def _significant(offs: Sequence[dict[str, float]], usages: Sequence[Usage]) -> list[dict[str, float]]:
    """Each path's surprises, without those of directions too lightly loaded to matter.

    A throttle lets a lightly loaded path through in bursts (a slice of its rate after each pause),
    so its busy time swings several times either way from one update to the next. A direction that
    took under ``SIGNIFICANT`` of the longest busy time of the update, and would have under it at
    the edge of what it did before (its time over its surprise), does not decide it: its surprise
    counts as none.
    """
    busy = [{kind: seconds for kind, _, seconds in directions(usage)} for usage in usages]
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
                kind: 1.0 if any(far(o[kind]) >= CHANGE and (o[kind] - 1) * (ratio - 1) > 0 for o in others) else ratio
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
