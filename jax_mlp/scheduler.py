"""The policy: the order subgroups are updated in, which path holds each one, and when to move them.

* **Order.** ``"alternate"`` runs ascending on even steps and descending on odd ones, so the
  subgroups updated last in one step are still in the host cache when the next step starts with
  them. ``"ascending"`` is the baseline.
* **Placement.** Subgroups are spread over the paths in the shares of :func:`model.best_split`,
  interleaved in update order (a smooth weighted round robin by bytes), so consecutive reads hit
  different paths at once. ``"round_robin"`` splits them equally, like a fixed ratio.
* **Rebalancing.** After each update the scheduler measures each path's throughput (bytes moved
  over busy time), keeps an exponential average that resets on a large change, and recomputes the
  split when the paths' busy times drift apart, moving as few subgroups as that takes. A moved
  subgroup is written to its new path at its next write-back, which happens every step anyway, so
  a move costs no extra I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax_mlp import model
from jax_mlp.model import PathSpeed
from jax_mlp.storage.traffic import Usage

_SMOOTHING = 0.5
_RESET_RATIO = 1.5
_MIN_SHARE_CHANGE = 0.05


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


def shift_placement(placement: Sequence[int], record_bytes: Sequence[int], shares: Sequence[float]) -> list[int]:
    """Moves as few records as it takes to reach ``shares``, spread evenly along the update order."""
    placement = list(placement)
    total = sum(record_bytes)
    deficit = [share * total for share in shares]
    for index, nbytes in zip(placement, record_bytes, strict=True):
        deficit[index] -= nbytes
    for source in range(len(shares)):
        mine = [k for k, p in enumerate(placement) if p == source]
        if deficit[source] >= 0 or not mine:
            continue
        count = min(len(mine), round(-deficit[source] / (sum(record_bytes[k] for k in mine) / len(mine))))
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
      tolerance: relative drift of the paths' busy times that triggers a new split.
    """

    def __init__(
        self,
        record_bytes: Sequence[int],
        speeds: Sequence[PathSpeed],
        *,
        order: str = "alternate",
        placement: str = "bandwidth",
        rebalance: bool = True,
        tolerance: float = 0.15,
    ):
        self.record_bytes = list(record_bytes)
        self.speeds = list(speeds)
        self.order_kind = order
        self.balanced = placement == "bandwidth"
        self.rebalance = rebalance and self.balanced
        self.tolerance = tolerance
        self.shares = self._target_shares()
        self.placement = weighted_interleave(self.record_bytes, self.shares)
        self.moves = 0

    def _target_shares(self) -> tuple[float, ...]:
        if self.balanced:
            return model.best_split(self.speeds)
        return tuple(1 / len(self.speeds) for _ in self.speeds)

    def order(self, step: int) -> list[int]:
        """The order in which step ``step`` updates the subgroups."""
        ascending = list(range(len(self.record_bytes)))
        return ascending[::-1] if self.order_kind == "alternate" and step % 2 else ascending

    def observe(self, usages: Sequence[Usage]) -> None:
        """Learns from what each path moved since the last call, and moves subgroups if the split changed.

        A path's throughput is its bytes over its busy time, with writes weighted by the current
        read/write bandwidth ratio, so one busy timeline updates both of its bandwidths.
        """
        busy = []
        for index, usage in enumerate(usages):
            speed = self.speeds[index]
            if usage.busy_seconds <= 0 or usage.bytes_read + usage.bytes_written == 0:
                continue
            ratio = speed.read_bandwidth / speed.write_bandwidth
            measured = (usage.bytes_read + ratio * usage.bytes_written) / usage.busy_seconds
            previous = speed.read_bandwidth
            change = max(measured, previous) / min(measured, previous)
            estimate = measured if change > _RESET_RATIO else _SMOOTHING * measured + (1 - _SMOOTHING) * previous
            self.speeds[index] = speed._replace(read_bandwidth=estimate, write_bandwidth=estimate / ratio)
            busy.append(usage.busy_seconds)
        if not self.rebalance or len(busy) < 2 or max(busy) <= (1 + self.tolerance) * min(busy):
            return
        shares = self._target_shares()
        if max(abs(a - b) for a, b in zip(shares, self.shares, strict=True)) < _MIN_SHARE_CHANGE:
            return
        placement = shift_placement(self.placement, self.record_bytes, shares)
        self.moves += sum(a != b for a, b in zip(placement, self.placement, strict=True))
        self.shares, self.placement = shares, placement
