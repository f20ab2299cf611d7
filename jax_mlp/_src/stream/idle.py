"""The I/O between updates: dirty cached records written back, the next update's first records read ahead.

It overlaps the user's forward and backward passes, when the disks would otherwise be idle. Each
transfer is counted towards the next update's stats. The engine runs it on its threads: the reads
through the stream's own counted fetch (the one an update's reader threads call), the write-back
through the tier stack's ``write_back``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from jax_mlp._src.config import OffloadConfig
from jax_mlp._src.schedule.scheduler import Scheduler
from jax_mlp._src.stats import IOCounters
from jax_mlp._src.storage.cache import CacheEntry
from jax_mlp._src.storage.tier_stack import TierStack
from jax_mlp._src.stream.engine import Engine, ReadAhead


@dataclasses.dataclass
class IdleIO:
    """Write-back and read-ahead between updates, for one offloader.

    Attributes:
      config: the options (``flush``, ``idle_prefetch``, ``prefetch_depth``, ``write_depth``).
      scheduler: the order of the next update, and the path of each record.
      tiers: the host cache in front of the paths.
      engine: the threads the work runs on.
      counters: where the write-backs are counted (towards the next update).
      fetch: ``fetch(index, step)``, a subgroup's fields at a step from the tiers, counted: the stream's own.
    """

    config: OffloadConfig
    scheduler: Scheduler
    tiers: TierStack
    engine: Engine
    counters: IOCounters
    fetch: Callable[[int, int], Any]
    _ahead: ReadAhead = dataclasses.field(default_factory=ReadAhead, init=False)
    _taken: frozenset[int] = dataclasses.field(default=frozenset(), init=False)  # of _ahead, from memory

    def after_update(self, step: int, in_memory: Mapping[int, Any] = MappingProxyType({})) -> None:
        """Starts the idle-time I/O of the tiers at ``step``: write-back (``flush="idle"``) and read-ahead.

        ``in_memory`` holds records of ``step`` still on their way to their paths (their fields, by
        subgroup): the read-ahead takes those it meets from memory, as cache hits, and reads the others.
        """
        if self.config.flush == "idle":
            self._write_back_dirty()
        if self.config.idle_prefetch:
            self._read_ahead(step, self.config.prefetch_depth, in_memory)

    def use_window(self, step: int) -> None:
        """A call that only accumulates gradients: the disks stay idle for the next update, so read further ahead.

        The write-back and read-ahead started by the last update run on through the whole window.
        Once the write-back has drained, the writers' share of host memory is free until the next
        update, so the read-ahead grows to ``prefetch_depth + write_depth`` records: the update
        consumes them first, before its own stores fill that share again.
        """
        if not self.config.idle_prefetch:
            return
        depth = self.config.prefetch_depth
        if self.engine.background_done():
            depth += self.config.write_depth
        self._read_ahead(step, depth)

    def take_ahead(self) -> ReadAhead:
        """The reads started so far, handed to the update that starts now."""
        ahead, self._ahead, self._taken = self._ahead, ReadAhead(), frozenset()
        return ahead

    @property
    def prefetched(self) -> tuple[int, ...]:
        """The subgroups read ahead for the next update, in the order they were started."""
        return self._ahead.keys()

    def flush(self) -> None:
        """Writes every dirty cached record, waits for it, then drops the records moves left behind."""
        self._write_back_dirty()
        self.engine.wait_background()
        self.tiers.drop_moved()

    def settle(self) -> None:
        """Cancels or waits out the reads ahead (closing)."""
        self.engine.settle(self._ahead.take_all())

    def _read_ahead(self, step: int, depth: int, in_memory: Mapping[int, Any] = MappingProxyType({})) -> None:
        """Starts reading the first ``depth`` uncached records of step ``step``'s order; takes those before the
        last of them that ``in_memory`` holds from it."""
        started = self._ahead.keys()
        reads = len(set(started) - self._taken)
        fetch = functools.partial(self.fetch, step=step)
        for index in self.scheduler.order(step):
            if reads >= depth:
                return
            if index in started or self.tiers.cache.holds(index, step):
                continue
            if index in in_memory:
                taken: concurrent.futures.Future = concurrent.futures.Future()
                taken.set_result(in_memory[index])
                self._ahead.add(index, taken)
                self._taken |= {index}
                self.counters.hit()
            else:
                self._ahead.add(index, self.engine.read_ahead(fetch, index))
                reads += 1

    def _write_back_dirty(self) -> None:
        """Queues every dirty cached record for writing, each to the path the scheduler gives it now."""
        placement = tuple(self.scheduler.placement)

        def write_back(index: int, entry: CacheEntry) -> None:
            self.counters.count(self.tiers.write_back(index, entry, placement[index]))

        for index, entry in self.tiers.cache.dirty():
            self.engine.write_behind(write_back, index, entry)
