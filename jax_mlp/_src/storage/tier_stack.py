"""The tier stack: the host cache in front of the paths, and where each subgroup's newest record lives."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from jax_mlp._src.errors import OffloadError
from jax_mlp._src.storage.cache import CacheEntry, HostCache
from jax_mlp._src.storage.paths import PathStore
from jax_mlp._src.storage.record import HEADER_SIZE, RecordCodec, record_name, verify


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

    def keeps(self, subgroup: int, path: int, slot: int | None = None) -> bool:
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


class RecordIO(NamedTuple):
    """One record read from or written to a path, as the tier stack reports it to its caller.

    Attributes:
      kind: ``"read"`` or ``"write"``.
      path: the index of the path.
      subgroup: the record's subgroup.
      nbytes: the record's size, header included.
      start: when the transfer started (``time.perf_counter()``).
      end: when it ended.
    """

    kind: str
    path: int
    subgroup: int
    nbytes: int
    start: float
    end: float


class Fetched(NamedTuple):
    """A subgroup's fields, and the read that brought them (None: the host cache served them)."""

    fields: Any
    read: RecordIO | None


class Unwritten(NamedTuple):
    """A record :meth:`TierStack.stage` kept in memory for :meth:`TierStack.land` to write.

    Attributes:
      subgroup: the record's subgroup.
      entry: its fields and the step they hold.
      path: the index of the path it goes to.
    """

    subgroup: int
    entry: CacheEntry
    path: int


class Locations(NamedTuple):
    """Where each subgroup's newest stored record lives, and the old records that moved subgroups left.

    Attributes:
      paths: the index of the path holding each subgroup's newest stored record.
      moved: (subgroup, old path) of each record a move left behind, deleted once that is safe.
    """

    paths: Mapping[int, int]
    moved: tuple[tuple[int, int], ...]


class TierStack:
    """The cache in front of the paths: fetch a subgroup's fields at a step, store new ones.

    Fields go in and come out; ``codec`` packs them into a record only when they leave RAM for a
    path, and unpacks what is read back. Each store is told the path each subgroup's record goes
    to (its caller's placement, as data), and each read and write comes back as a
    :class:`RecordIO`. Where each subgroup's newest stored record lives is kept under a lock, since
    reader and writer threads use it at once. Dirty cached fields reach storage on eviction or
    through :meth:`write_back`.

    Args:
      cache: the host cache (capacity 0 disables it).
      paths: the storage paths.
      layout_hash: the plan's hash, checked in every record read.
      codec: packs fields into sealed records and unpacks verified payloads.
    """

    def __init__(self, cache: HostCache, paths: list[PathStore], layout_hash: bytes, codec: RecordCodec):
        self.cache = cache
        self.paths = paths
        self.layout_hash = layout_hash
        self.codec = codec
        self._lock = threading.Lock()
        self._path_of: dict[int, int] = {}  # the path index of each subgroup's newest stored record
        self._moved: list[tuple[int, int]] = []  # (subgroup, old path) of records moves left behind
        self._unwritten: dict[int, CacheEntry] = {}  # records staged and not yet written (see stage)
        self._pins: list[Pin] = []

    @property
    def locations(self) -> Locations:
        """Where every stored record is now (a snapshot: :meth:`restore` takes it back)."""
        with self._lock:
            return Locations(dict(self._path_of), tuple(self._moved))

    def restore(self, locations: Locations) -> None:
        """Takes back an earlier :attr:`locations` (an update that failed), or those a resume found."""
        with self._lock:
            self._path_of, self._moved = dict(locations.paths), list(locations.moved)

    def set_caps(self, path: int | str, max_read: float | None, max_write: float | None) -> None:
        """Changes the bandwidth caps (bytes/s, None for none) of a path, given by index or name."""
        index = path if isinstance(path, int) else [p.root for p in self.paths].index(path)
        self.paths[index].traffic.set_caps(max_read, max_write)

    def pin(self, step: int, timeout: float) -> Pin:
        """Pins ``step`` for a reader beside training; call it only when ``step`` is complete on storage."""
        pin = Pin(step, self.locations.paths, timeout)
        with self._lock:
            self._pins = [p for p in self._pins if not p.released] + [pin]
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

    def fetch(self, subgroup: int, step: int, *, keep: bool = False) -> Fetched:
        """The fields of ``subgroup`` at ``step``, from the cache or the path holding its record (verified).

        With ``keep``, fields read from a path stay in the cache as a clean entry where clean entries can
        make room (:meth:`HostCache.offer`): the params a layer-streamed forward reads last are those its
        backward reads first.
        """
        entry = self.cache.get(subgroup)
        if entry is not None and entry.step == step:
            return Fetched(entry.fields, None)
        with self._lock:
            entry, index = self._unwritten.get(subgroup), self._path_of.get(subgroup)
        if entry is not None and entry.step == step:  # on its way to its path
            return Fetched(entry.fields, None)
        if index is None:
            raise OffloadError(
                f"subgroup {subgroup} has no record of step {step} in the host cache or on any path; "
                "restore the last checkpoint"
            )
        started = time.perf_counter()
        payload = self._read(self.paths[index], subgroup, step)
        nbytes = HEADER_SIZE + payload.nbytes
        read = RecordIO("read", index, subgroup, nbytes, started, time.perf_counter())
        fields = self.codec.unpack(subgroup, payload)
        if keep:
            self.cache.offer(subgroup, CacheEntry(fields, nbytes, step, dirty=False))
        return Fetched(fields, read)

    def write(self, subgroup: int, fields: Any, step: int, path: int) -> RecordIO:
        """Packs ``fields`` into a sealed record and writes it, as step ``step``, to path index ``path``."""
        for pin in self._live_pins():
            if pin.keeps(subgroup, path, step % 2):
                pin.wait(subgroup)
        record = self.codec.pack(subgroup, fields, step)
        started = time.perf_counter()
        self.paths[path].write(subgroup, step % 2, record)
        written = RecordIO("write", path, subgroup, record.nbytes, started, time.perf_counter())
        with self._lock:
            previous = self._path_of.get(subgroup)
            if previous is not None and previous != path:
                self._moved.append((subgroup, previous))
            self._path_of[subgroup] = path
        return written

    def drop_moved(self) -> None:
        """Removes the records that moved subgroups left on their old paths, once that is safe.

        It is safe once the newest step is complete on storage, that is when no write is in flight
        (the caller's part) and no cached record is dirty: until then the old path's record may be
        the last complete step. A record still pinned for a reader is kept for a later call.
        """
        with self._lock:
            if self._unwritten or self.cache.dirty():
                return
            pins = [p for p in self._pins if not p.released]
            kept = [(k, old) for k, old in self._moved if any(pin.keeps(k, old) for pin in pins)]
            dropped = [(k, old) for k, old in self._moved if (k, old) not in kept and self._path_of.get(k) != old]
            self._moved = kept
        for subgroup, old in dropped:
            self.paths[old].delete(subgroup)

    def stage(
        self,
        subgroup: int,
        fields: Any,
        record_nbytes: int,
        step: int,
        placement: Sequence[int],
        cached: frozenset[int] | None = None,
    ) -> list[Unwritten]:
        """Keeps ``fields`` in the cache when their record of ``record_nbytes`` fits; returns what must be written.

        That is the record itself when the cache does not keep it, else the dirty records the cache evicted
        to make room; :meth:`land` writes each. Until then :meth:`fetch` finds them in memory. Each goes to
        the path ``placement`` gives its subgroup. ``cached``, when given, names the subgroups the cache may
        keep; any other is written, and its older cached record dropped.
        """
        entry = CacheEntry(fields, record_nbytes, step, dirty=True)
        if not self.cache.fits(record_nbytes) or (cached is not None and subgroup not in cached):
            self.cache.drop(subgroup)
            unwritten = [(subgroup, entry)]
        else:
            unwritten = [(k, old) for k, old in self.cache.put(subgroup, entry) if old.dirty]
        with self._lock:
            self._unwritten.update(unwritten)
        return [Unwritten(k, old, placement[k]) for k, old in unwritten]

    def land(self, unwritten: Unwritten) -> RecordIO:
        """Writes a record :meth:`stage` returned. If the write fails, the record stays in memory, readable,
        for :meth:`land_left` to write again: the step it belongs to is never lost."""
        written = self.write(unwritten.subgroup, unwritten.entry.fields, unwritten.entry.step, unwritten.path)
        with self._lock:
            if self._unwritten.get(unwritten.subgroup) is unwritten.entry:
                del self._unwritten[unwritten.subgroup]
        return written

    def land_left(self, placement: Sequence[int]) -> list[RecordIO]:
        """Writes the records a failed write left in memory, each to the path ``placement`` gives it now.

        Call it only when no write is in flight (every other unwritten record is then one a write failed on).
        """
        with self._lock:
            left = list(self._unwritten.items())
        return [self.land(Unwritten(k, entry, placement[k])) for k, entry in left]

    def discard_unwritten(self, step: int) -> None:
        """Forgets the unwritten records of ``step`` (a failed update's), once none of their writes is in flight."""
        with self._lock:
            self._unwritten = {k: e for k, e in self._unwritten.items() if e.step != step}

    def write_back(self, subgroup: int, entry: CacheEntry, path: int) -> RecordIO:
        """Writes dirty cached fields to path index ``path`` and marks them clean."""
        written = self.write(subgroup, entry.fields, entry.step, path)
        self.cache.mark_clean(subgroup, entry.step)
        return written

    def _live_pins(self) -> list[Pin]:
        with self._lock:
            return list(self._pins)
