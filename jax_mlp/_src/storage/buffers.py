"""Aligned host buffers for records, reused once nothing else refers to them.

O_DIRECT wants buffers, offsets and lengths in multiples of the logical block size, and
``jax.device_put`` on CPU aliases a 64-byte-aligned array instead of copying it.
"""

from __future__ import annotations

import collections
import sys
import threading

import numpy as np

ALIGNMENT = 4096  # O_DIRECT wants buffers, offsets and lengths in multiples of the logical block size
POOL_BYTES = 1024**3  # record buffers kept for reuse, idle or in use (see BufferPool)


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def _refs_at(buffers: collections.deque, index: int) -> int:
    return sys.getrefcount(buffers[index])


_UNSHARED_REFS = _refs_at(collections.deque([np.empty(0)]), 0)  # a buffer only the pool refers to


class BufferPool:
    """Aligned host buffers for records, handed out again once nothing else refers to them.

    A fresh buffer costs a page fault per page on first touch: packing a cached update's 512 MiB
    of records took 345 ms of thread time into fresh buffers here, 89 ms into reused ones. Reuse is
    only safe when nothing still reads the buffer: a device array that aliases it (``device_put``
    on CPU does so for 64-byte aligned arrays), a checkpoint reader's view. Each of
    these holds a Python reference to the buffer, so a buffer is reused only when the pool's
    reference is the only one.
    The pool remembers the buffers it made most recently, up to ``capacity`` bytes in all; buffers
    it forgets are freed as usual once their users let go.

    Args:
      capacity: bytes of buffers the pool keeps track of, idle or in use.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._buffers: collections.deque[np.ndarray] = collections.deque()
        self._nbytes = 0
        self._lock = threading.Lock()

    def _reuse(self, nbytes: int) -> np.ndarray | None:
        for index in range(len(self._buffers)):
            if self._buffers[index].nbytes == nbytes and _refs_at(self._buffers, index) == _UNSHARED_REFS:
                buffer = self._buffers[index]
                del self._buffers[index]
                self._buffers.append(buffer)
                return buffer
        return None

    def _remember(self, buffer: np.ndarray) -> None:
        self._buffers.append(buffer)
        self._nbytes += buffer.nbytes
        while self._nbytes > self.capacity and len(self._buffers) > 1:
            self._nbytes -= self._buffers.popleft().nbytes

    def take(self, nbytes: int, *, zeroed: bool) -> np.ndarray:
        """A buffer of ``nbytes`` whose first byte is ``ALIGNMENT``-aligned, all zeros if ``zeroed``."""
        with self._lock:
            raw = self._reuse(nbytes + ALIGNMENT)
        if raw is None:
            raw = (np.zeros if zeroed else np.empty)(nbytes + ALIGNMENT, dtype=np.uint8)
            with self._lock:
                self._remember(raw)
        elif zeroed:
            raw.fill(0)
        start = -raw.ctypes.data % ALIGNMENT
        return raw[start : start + nbytes]


BUFFERS = BufferPool(POOL_BYTES)


def aligned_buffer(nbytes: int, *, zeroed: bool = True) -> np.ndarray:
    """A uint8 buffer from :data:`BUFFERS` whose first byte is ``ALIGNMENT``-aligned.

    O_DIRECT needs the alignment, and ``jax.device_put`` on CPU then aliases a record's fields
    (64-byte aligned) instead of copying them.
    """
    return BUFFERS.take(nbytes, zeroed=zeroed)
