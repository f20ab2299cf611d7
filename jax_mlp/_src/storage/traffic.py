"""Everything between a path's callers and its device: in-flight limit, node lock, caps, meter."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple


class TokenBucket:
    """Paces one path as a single pipe of capped bandwidth shared by its reads and writes.

    A transfer of ``n`` bytes occupies the pipe for ``n / rate`` seconds after the previous one;
    the caller sleeps until its slot ends. Reads and writes share the pipe, like a real device.
    """

    def __init__(self, max_read: float | None, max_write: float | None):
        self._lock = threading.Lock()
        self._free_at = 0.0
        self.set_caps(max_read, max_write)

    def set_caps(self, max_read: float | None, max_write: float | None) -> None:
        """Changes the caps (bytes/s, None for none); takes effect on the next transfer."""
        with self._lock:
            self.caps = {"read": max_read, "write": max_write}

    def pace(self, kind: str, nbytes: int, started: float) -> None:
        """Sleeps until a transfer of ``nbytes`` that started at ``started`` may end."""
        with self._lock:
            rate = self.caps[kind]
            if rate is None:
                return
            end = max(started, self._free_at) + nbytes / rate
            self._free_at = end
        delay = end - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class NodeLock:
    """An exclusive lock on one path shared by the processes of a node (``fcntl.flock`` on a file).

    Threads of one process share the hold: the first to enter takes the file lock, the last to
    leave releases it. A process that dies releases it with its file descriptors.
    """

    def __init__(self, lock_file: str):
        self.lock_file = lock_file
        self._condition = threading.Condition()
        self._holders = 0
        self._fd: int | None = None

    def __enter__(self) -> NodeLock:
        with self._condition:
            if self._holders == 0:
                fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o666)
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._fd = fd
            self._holders += 1
        return self

    def __exit__(self, *exc_info: Any) -> None:
        with self._condition:
            self._holders -= 1
            if self._holders == 0:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                os.close(self._fd)
                self._fd = None


class Usage(NamedTuple):
    """What one path moved since the last look, and for how long it was busy doing it.

    Busy times are unions of transfer intervals: ``read_busy_seconds`` of the reads,
    ``write_busy_seconds`` of the writes, ``busy_seconds`` of both. A device that serves both
    directions at once (full duplex) has ``busy_seconds`` near the larger of the two; one that serves
    them as one pipe, near their sum.
    """

    bytes_read: int
    bytes_written: int
    busy_seconds: float
    read_busy_seconds: float = 0.0
    write_busy_seconds: float = 0.0


class _Meter:
    """The union of a set of overlapping intervals, accumulated as they start and end."""

    def __init__(self):
        self.active = 0
        self.since = 0.0
        self.busy = 0.0

    def start(self, now: float) -> None:
        if self.active == 0:
            self.since = now
        self.active += 1

    def end(self, now: float) -> None:
        self.active -= 1
        if self.active == 0:
            self.busy += now - self.since

    def take(self, now: float) -> float:
        """The busy time since the previous take; a running interval counts up to ``now`` and restarts there."""
        busy, self.busy = self.busy, 0.0
        if self.active:
            busy += now - self.since
            self.since = now
        return busy


class Traffic:
    """Everything between a path's callers and its device: in-flight limit, node lock, caps, meter.

    Args:
      max_inflight: transfers in flight at once on this path, in this process.
      lock_file: a node-local lock file shared by the processes that use this path, or None.
      max_read: read cap in bytes/s, or None.
      max_write: write cap in bytes/s, or None.
    """

    def __init__(self, max_inflight: int, lock_file: str | None, max_read: float | None, max_write: float | None):
        self._inflight = threading.BoundedSemaphore(max_inflight)
        self._node_lock = NodeLock(lock_file) if lock_file else contextlib.nullcontext()
        self.bucket = TokenBucket(max_read, max_write)
        self._lock = threading.Lock()
        self._meters = {"any": _Meter(), "read": _Meter(), "write": _Meter()}
        self._bytes = {"read": 0, "write": 0}

    def set_caps(self, max_read: float | None, max_write: float | None) -> None:
        """Changes the caps (bytes/s, None for none); takes effect on the next transfer."""
        self.bucket.set_caps(max_read, max_write)

    @contextlib.contextmanager
    def metered(self, kind: str, nbytes: int) -> Iterator[None]:
        """Holds the path for one whole-record read or write of ``nbytes`` (``kind``): in flight, locked, paced, metered."""
        with self._inflight, self._node_lock:
            started = time.monotonic()
            with self._lock:
                for meter in (self._meters["any"], self._meters[kind]):
                    meter.start(started)
            try:
                yield
                self.bucket.pace(kind, nbytes, started)
            finally:
                ended = time.monotonic()
                with self._lock:
                    self._bytes[kind] += nbytes
                    for meter in (self._meters["any"], self._meters[kind]):
                        meter.end(ended)

    def take_usage(self) -> Usage:
        """The usage since the previous call (transfers still running count in the next)."""
        with self._lock:
            now = time.monotonic()
            busy = {name: meter.take(now) for name, meter in self._meters.items()}
            usage = Usage(self._bytes["read"], self._bytes["write"], busy["any"], busy["read"], busy["write"])
            self._bytes = {"read": 0, "write": 0}
            return usage
