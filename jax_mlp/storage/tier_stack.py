"""The tier stack: the host cache in front of the paths, and where each subgroup's newest record lives."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np

from jax_mlp.errors import OffloadError
from jax_mlp.storage.cache import CacheEntry, HostCache
from jax_mlp.storage.paths import PathStore
from jax_mlp.storage.record import HEADER_SIZE, RecordCodec, record_name, verify


class Pin:
    """A step held for a reader beside training (a checkpoint save): its records stay until read.

    A write that would overwrite a pinned record not yet read, or a move that would delete it,
    waits for the reader; everything else goes on.

    Args:
      step: the pinned step, complete on storage.
      locations: the index of the path holding each subgroup's record of ``step``.
      timeout: seconds a write may wait for the reader before it fails.
    """

    def __init__(self, step: int, locations: dict[int, int], timeout: float):
        self.step = step
        self.locations = dict(locations)
        self.timeout = timeout
        self._unread = set(self.locations)
        self._condition = threading.Condition()

    @property
    def released(self) -> bool:
        with self._condition:
            return not self._unread

    def blocks(self, subgroup: int, path: int, slot: int | None = None) -> bool:
        """Whether ``subgroup``'s pinned record is unread and on ``path`` (in ``slot``, if given)."""
        with self._condition:
            unread = subgroup in self._unread and self.locations[subgroup] == path
            return unread and slot in (None, self.step % 2)

    def mark_read(self, subgroup: int) -> None:
        with self._condition:
            self._unread.discard(subgroup)
            self._condition.notify_all()

    def release(self) -> None:
        """Unpins every record (the reader is done or gave up)."""
        with self._condition:
            self._unread.clear()
            self._condition.notify_all()

    def wait(self, subgroup: int) -> None:
        """Waits until ``subgroup``'s pinned record has been read, at most ``timeout`` seconds."""
        with self._condition:
            if not self._condition.wait_for(lambda: subgroup not in self._unread, self.timeout):
                raise OffloadError(
                    f"a reader of step {self.step} (a checkpoint save) has not read subgroup {subgroup} within "
                    f"{self.timeout:g}s, and the next record would overwrite it; wait for the save to finish "
                    "(CheckpointManager.wait_until_finished) before updating again, or raise io_timeout"
                )


class TierStack:
    """The cache in front of the paths: fetch a subgroup's fields at a step, store new ones.

    Fields go in and come out; ``codec`` packs them into a record only when they leave RAM for a
    path, and unpacks what is read back. Where each subgroup's newest stored record lives is
    tracked in ``locations``; new records go to the path ``placement`` names. Dirty cached fields
    reach storage on eviction or through :meth:`write_back`.

    Args:
      cache: the host cache (capacity 0 disables it).
      paths: the storage paths.
      layout_hash: the plan's hash, checked in every record read.
      placement: maps a subgroup index to the index of the path its next record goes to.
      counters: where bytes moved and cache hits are counted.
      codec: packs fields into sealed records and unpacks verified payloads.
    """

    def __init__(
        self, cache: HostCache, paths: list[PathStore], layout_hash: bytes, placement, counters, codec: RecordCodec
    ):
        self.cache = cache
        self.paths = paths
        self.layout_hash = layout_hash
        self.placement = placement
        self.counters = counters
        self.codec = codec
        self.locations: dict[int, int] = {}
        self.moved: list[tuple[int, int]] = []
        self.pins: list[Pin] = []

    def set_caps(self, path: int | str, max_read: float | None, max_write: float | None) -> None:
        """Changes the bandwidth caps (bytes/s, None for none) of a path, given by index or name."""
        index = path if isinstance(path, int) else [p.root for p in self.paths].index(path)
        self.paths[index].traffic.set_caps(max_read, max_write)

    def pin(self, step: int, timeout: float) -> Pin:
        """Pins ``step`` for a reader beside training; call it only when ``step`` is complete on storage."""
        pin = Pin(step, self.locations, timeout)
        self.pins = [p for p in self.pins if not p.released] + [pin]
        return pin

    def read_pinned(self, pin: Pin, subgroup: int) -> Any:
        """The fields of ``subgroup`` at the pinned step, then unpinned; not counted in the stats.

        They come from the cache while the cache still holds that step, else from storage (verified).
        """
        entry = self.cache.peek(subgroup)
        if entry is not None and entry.step == pin.step:
            fields = entry.fields
        else:
            payload = self._read(self.paths[pin.locations[subgroup]], subgroup, pin.step)
            fields = self.codec.unpack(subgroup, payload)
        pin.mark_read(subgroup)
        return fields

    def _read(self, path: PathStore, subgroup: int, step: int) -> np.ndarray:
        """The payload of the record of ``subgroup`` at ``step`` on ``path``, verified."""
        record = path.read(subgroup, step % 2)
        name = os.path.join(path.directory, record_name(subgroup, step % 2))
        return verify(record, name=name, step=step, layout_hash=self.layout_hash)

    def fetch(self, subgroup: int, step: int) -> Any:
        """The fields of ``subgroup`` at ``step``, from the cache or its path (verified)."""
        entry = self.cache.get(subgroup)
        if entry is not None and entry.step == step:
            self.counters.hit()
            return entry.fields
        path = self.paths[self.locations.get(subgroup, self.placement(subgroup))]
        started = time.perf_counter()
        payload = self._read(path, subgroup, step)
        self.counters.read(path.root, HEADER_SIZE + payload.nbytes, subgroup=subgroup, started=started)
        return self.codec.unpack(subgroup, payload)

    def write(self, subgroup: int, fields: Any, step: int) -> None:
        """Packs ``fields`` into a sealed record and writes it, as step ``step``, to the path the placement picks."""
        index = self.placement(subgroup)
        for pin in self.pins:
            if pin.blocks(subgroup, index, step % 2):
                pin.wait(subgroup)
        record = self.codec.pack(subgroup, fields, step)
        started = time.perf_counter()
        self.paths[index].write(subgroup, step % 2, record)
        self.counters.wrote(self.paths[index].root, record.nbytes, subgroup=subgroup, started=started)
        previous = self.locations.get(subgroup)
        self.locations[subgroup] = index
        if previous is not None and previous != index:
            self.moved.append((subgroup, previous))

    def drop_moved(self) -> None:
        """Removes the records that moved subgroups left on their old paths.

        Call it only when the newest step is complete on storage: until then the old path's
        record is the previous complete step. A record still pinned for a reader is kept for a
        later call.
        """
        moved, self.moved = self.moved, []
        for subgroup, old in moved:
            if any(pin.blocks(subgroup, old) for pin in self.pins):
                self.moved.append((subgroup, old))
            elif self.locations.get(subgroup) != old:
                self.paths[old].delete(subgroup)

    def store(self, subgroup: int, fields: Any, record_nbytes: int, step: int) -> None:
        """Keeps ``fields`` in the cache when their record of ``record_nbytes`` fits (writing back
        what that evicts), else writes them."""
        if not self.cache.fits(record_nbytes):
            self.write(subgroup, fields, step)
            return
        for victim, entry in self.cache.put(subgroup, CacheEntry(fields, record_nbytes, step, dirty=True)):
            if entry.dirty:
                self.write(victim, entry.fields, entry.step)

    def write_back(self, subgroup: int, entry: CacheEntry) -> None:
        """Writes dirty cached fields to storage and marks them clean."""
        self.write(subgroup, entry.fields, entry.step)
        self.cache.mark_clean(subgroup, entry.step)
