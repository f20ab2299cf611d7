"""The I/O between updates: dirty cached records written back, the next update's first records read ahead.

It overlaps the user's forward and backward passes, when the disks would otherwise be idle. Each
transfer is counted towards the next update's stats. The engine runs it on its threads through
the same two callables an update uses: a counted fetch, and a store (here, a write-back).
"""

from __future__ import annotations

import functools
from typing import Any

from jax_mlp.config import OffloadConfig
from jax_mlp.engine import Engine, ReadAhead
from jax_mlp.scheduler import Scheduler
from jax_mlp.stats import IOCounters
from jax_mlp.storage.cache import CacheEntry
from jax_mlp.storage.tier_stack import TierStack


def fetch_counted(tiers: TierStack, counters: IOCounters, index: int, step: int) -> Any:
    """Subgroup ``index``'s fields at ``step`` from the tiers, counted as a cache hit or a read."""
    fetched = tiers.fetch(index, step)
    if fetched.read is None:
        counters.hit()
    else:
        counters.count(fetched.read)
    return fetched.fields


class IdleIO:
    """Write-back and read-ahead between updates, for one offloader.

    Args:
      config: the options (``flush``, ``idle_prefetch``, ``prefetch_depth``, ``write_depth``).
      scheduler: the order of the next update, and the path of each record.
      tiers: the host cache in front of the paths.
      engine: the threads the work runs on.
      counters: where the transfers are counted (towards the next update).
    """

    def __init__(
        self, config: OffloadConfig, scheduler: Scheduler, tiers: TierStack, engine: Engine, counters: IOCounters
    ):
        self._config = config
        self._scheduler = scheduler
        self._tiers = tiers
        self._engine = engine
        self._counters = counters
        self._ahead = ReadAhead()

    def after_update(self, step: int) -> None:
        """Starts the idle-time I/O of the tiers at ``step``: write-back (``flush="idle"``) and read-ahead."""
        if self._config.flush == "idle":
            self._write_back_dirty()
        if self._config.idle_prefetch:
            self._read_ahead(step, self._config.prefetch_depth)

    def use_window(self, step: int) -> None:
        """A call that only accumulates gradients: the disks stay idle for the next update, so read further ahead.

        The write-back and read-ahead started by the last update run on through the whole window.
        Once the write-back has drained, the writers' share of host memory is free until the next
        update, so the read-ahead grows to ``prefetch_depth + write_depth`` records: the update
        consumes them first, before its own stores fill that share again.
        """
        if not self._config.idle_prefetch:
            return
        depth = self._config.prefetch_depth
        if self._engine.background_done():
            depth += self._config.write_depth
        self._read_ahead(step, depth)

    def take_ahead(self) -> ReadAhead:
        """The reads started so far, handed to the update that starts now."""
        ahead, self._ahead = self._ahead, ReadAhead()
        return ahead

    @property
    def prefetched(self) -> tuple[int, ...]:
        """The subgroups read ahead for the next update, in the order they were started."""
        return self._ahead.keys()

    def flush(self) -> None:
        """Writes every dirty cached record, waits for it, then drops the records moves left behind."""
        self._write_back_dirty()
        self._engine.wait_background()
        self._tiers.drop_moved()

    def settle(self) -> None:
        """Cancels or waits out the reads ahead (closing)."""
        self._engine.settle(self._ahead.take_all())

    def _read_ahead(self, step: int, depth: int) -> None:
        """Starts reading the first ``depth`` uncached records of step ``step``'s order."""
        started = self._ahead.keys()
        fetch = functools.partial(fetch_counted, self._tiers, self._counters, step=step)
        for index in self._scheduler.order(step):
            if len(started) >= depth:
                return
            if index not in started and not self._tiers.cache.holds(index, step):
                self._ahead.add(index, self._engine.read_ahead(fetch, index))
                started = (*started, index)

    def _write_back_dirty(self) -> None:
        """Queues every dirty cached record for writing, each to the path the scheduler gives it now."""
        placement = tuple(self._scheduler.placement)

        def write_back(index: int, entry: CacheEntry) -> None:
            self._counters.count(self._tiers.write_back(index, entry, placement[index]))

        for index, entry in self._tiers.cache.dirty():
            self._engine.write_behind(write_back, index, entry)
