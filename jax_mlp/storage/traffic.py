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
    """What one path moved since the last look, and for how long it was busy doing it."""

    bytes_read: int
    bytes_written: int
    busy_seconds: float


class Traffic:
    """Everything between a path's callers and its device: in-flight limit, node lock, caps, meter.

    Args:
      max_inflight: transfers in flight at once on this path, in this process.
      lock_file: a node-local lock file shared by the processes that use this path, or None.
      max_read: read cap in bytes/s, or None.
      max_write: write cap in bytes/s, or None.
    """

    def __init__(self, max_inflight: int = 4, lock_file: str | None = None, max_read=None, max_write=None):
        self._inflight = threading.BoundedSemaphore(max_inflight)
        self._node_lock = NodeLock(lock_file) if lock_file else contextlib.nullcontext()
        self.bucket = TokenBucket(max_read, max_write)
        self._lock = threading.Lock()
        self._active = 0
        self._busy_since = 0.0
        self._usage = Usage(0, 0, 0.0)

    def set_caps(self, max_read: float | None, max_write: float | None) -> None:
        """Changes the caps (bytes/s, None for none); takes effect on the next transfer."""
        self.bucket.set_caps(max_read, max_write)

    @contextlib.contextmanager
    def transfer(self, kind: str, nbytes: int) -> Iterator[None]:
        """Holds the path for one whole-record transfer of ``nbytes`` (``kind`` is read or write)."""
        with self._inflight, self._node_lock:
            started = time.monotonic()
            with self._lock:
                if self._active == 0:
                    self._busy_since = started
                self._active += 1
            try:
                yield
                self.bucket.pace(kind, nbytes, started)
            finally:
                ended = time.monotonic()
                with self._lock:
                    self._active -= 1
                    read, written, busy = self._usage
                    if kind == "read":
                        read += nbytes
                    else:
                        written += nbytes
                    if self._active == 0:
                        busy += ended - self._busy_since
                    self._usage = Usage(read, written, busy)

    def take_usage(self) -> Usage:
        """The usage since the previous call (transfers still running count in the next)."""
        with self._lock:
            usage, self._usage = self._usage, Usage(0, 0, 0.0)
            if self._active:
                now = time.monotonic()
                usage = usage._replace(busy_seconds=usage.busy_seconds + now - self._busy_since)
                self._busy_since = now
            return usage
