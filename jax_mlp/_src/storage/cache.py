"""The host cache: a bounded LRU of subgroups' fields in host RAM, which never does I/O itself."""

from __future__ import annotations

import collections
import threading
from typing import Any, NamedTuple


class CacheEntry(NamedTuple):
    """A cached subgroup: its fields, the size of their record, the step they hold and whether
    storage lacks them."""

    fields: Any
    nbytes: int
    step: int
    dirty: bool


class HostCache:
    """A bounded LRU cache of subgroups' fields in host RAM, keyed by subgroup index.

    It holds fields as computed, not packed records: a subgroup that lives and dies in the cache
    is never copied into a record (packing was 60% of a cached update here). Its capacity counts
    each entry at the size of its record.

    ``put`` returns what it evicted so the caller can write dirty records back; the cache itself
    never does I/O.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: collections.OrderedDict[int, CacheEntry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0

    def get(self, key: int) -> CacheEntry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def holds(self, key: int, step: int) -> bool:
        """Whether ``key``'s record at ``step`` is cached (without touching the LRU order)."""
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and entry.step == step

    def peek(self, key: int) -> CacheEntry | None:
        """The cached entry of ``key``, or None, without touching the LRU order."""
        with self._lock:
            return self._entries.get(key)

    def fits(self, nbytes: int) -> bool:
        """Whether a record of ``nbytes`` can be cached at all."""
        return nbytes <= self.capacity

    def put(self, key: int, entry: CacheEntry) -> list[tuple[int, CacheEntry]]:
        """Caches ``entry`` and returns the entries evicted, least recently used first."""
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            evicted = []
            while self._entries and self.nbytes + entry.nbytes > self.capacity:
                victim_key, victim = self._entries.popitem(last=False)
                self.nbytes -= victim.nbytes
                evicted.append((victim_key, victim))
            self._entries[key] = entry
            self.nbytes += entry.nbytes
            return evicted

    def offer(self, key: int, entry: CacheEntry) -> bool:
        """Caches a clean ``entry`` where room can be made by evicting clean entries only; whether it did.

        What it evicts needs no write, so a reader may call it: a dirty entry evicted would be neither in
        the cache nor on its path until written, and a concurrent read of it would find the old record.
        A dirty entry of ``key`` is never replaced.
        """
        with self._lock:
            old = self._entries.get(key)
            if old is not None and old.dirty:
                return False
            needed = self.nbytes - (0 if old is None else old.nbytes) + entry.nbytes - self.capacity
            victims = []
            for victim, held in self._entries.items():  # least recently used first
                if needed <= 0:
                    break
                if victim != key and not held.dirty:
                    victims.append(victim)
                    needed -= held.nbytes
            if needed > 0:
                return False
            for victim in [*victims, *([key] if old is not None else [])]:
                self.nbytes -= self._entries.pop(victim).nbytes
            self._entries[key] = entry
            self.nbytes += entry.nbytes
            return True

    def drop(self, key: int) -> None:
        """Forgets ``key``'s entry, if any (its newer record goes to storage instead)."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self.nbytes -= entry.nbytes

    def mark_clean(self, key: int, step: int) -> None:
        """Marks the cached record of ``key`` at ``step`` as safely stored."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.step == step:
                self._entries[key] = entry._replace(dirty=False)

    def dirty(self) -> list[tuple[int, CacheEntry]]:
        with self._lock:
            return [(k, e) for k, e in self._entries.items() if e.dirty]

    def discard_unless_step(self, step: int) -> None:
        """Drops every entry that does not hold ``step`` (after a failed update)."""
        with self._lock:
            for key in [k for k, e in self._entries.items() if e.step != step]:
                self.nbytes -= self._entries.pop(key).nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0
