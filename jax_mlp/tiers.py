"""Tiers: a bounded host-RAM cache of subgroups' fields, and tensorstore-backed storage paths of records.

A *record* is one subgroup's state at one step: a 64-byte header (magic, version, step, payload
size, layout hash, and a CRC-32 of the header and payload) followed by the raw payload. Each record is a zarr3 uint8 array with the
``bytes`` codec and chunks of about 4 MiB. On a local directory its chunk files are moved by
:class:`ChunkFiles` (``os.pwrite``/``os.preadv``, O_DIRECT where allowed, many chunks in flight);
on any other kvstore by tensorstore (see docs/efficiency.md). Step ``s`` of subgroup ``k``
lives in slot ``s % 2``, so writing step ``s + 1`` never touches step ``s``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import tensorstore as ts

from jax_mlp.config import Path

try:  # ISA-L computes the same CRC-32 as zlib, five times faster here; it comes with the bench extra
    from isal.isal_zlib import crc32
except ImportError:
    from zlib import crc32

HEADER_SIZE = 64
CHUNK_BYTES = 4 * 1024**2
ALIGNMENT = 4096  # O_DIRECT wants buffers, offsets and lengths in multiples of the logical block size
CHUNK_REQUESTS = 8  # chunk files in flight per local path (measured: 4 to 8 reach the disk's bandwidth)
POOL_BYTES = 1024**3  # record buffers kept for reuse, idle or in use (see BufferPool)
_MAGIC = b"JMLP"
_VERSION = 1
_HEADER = struct.Struct("<4sHxxqQ16s")  # magic, version, step, payload bytes, layout hash
_CRC_OFFSET = HEADER_SIZE - 4  # the CRC-32 of bytes [0, 60) and of the payload ends the header
RUN_FILE = "run.json"


class OffloadError(RuntimeError):
    """Base class of jax_mlp's errors; raised itself for misuse (update under jit, a stale opt_state,
    use after close, a directory of another run) and for I/O that exceeds ``io_timeout``."""


class PathError(OffloadError):
    """A storage path is missing, unwritable, full or gone."""


class RecordError(OffloadError):
    """Stored state failed its checks: a record torn, corrupt, or from another step, run or layout;
    a run of another layout on resume; or no step complete on every subgroup."""


def record_name(subgroup: int, slot: int) -> str:
    """The key of subgroup ``subgroup``'s record in ``slot``, relative to a path's directory."""
    return f"sg{subgroup:06d}.{slot}"


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def chunk_bytes(nbytes: int) -> int:
    """The zarr chunk size of a record of ``nbytes``: about ``CHUNK_BYTES``, equal chunks, block-aligned.

    zarr stores an edge chunk at full size, so splitting evenly wastes less than a block per chunk
    where fixed 4 MiB chunks would store a 64 MiB + 64 B record as 68 MiB. Block-aligned chunks
    can be moved with O_DIRECT.
    """
    count = -(-nbytes // CHUNK_BYTES)
    return _round_up(-(-nbytes // count), ALIGNMENT)


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


def new_record(payload_nbytes: int, *, zeroed: bool = True) -> np.ndarray:
    """An aligned buffer for a record (header room plus payload), padded with zeros up to whole
    chunks, so every chunk file is written straight from it.

    Args:
      payload_nbytes: the payload's size.
      zeroed: zero the header and payload too; pass False when the caller writes every byte (as
        :func:`jax_mlp.partition.pack` and :func:`seal` do), which saves a pass over a reused buffer.
    """
    nbytes = HEADER_SIZE + payload_nbytes
    buffer = aligned_buffer(_round_up(nbytes, chunk_bytes(nbytes)), zeroed=zeroed)
    buffer[nbytes:] = 0
    return buffer[:nbytes]


def payload_of(record: np.ndarray) -> np.ndarray:
    """The payload part of a record buffer (a view)."""
    return record[HEADER_SIZE:]


def _checksum(record: np.ndarray) -> int:
    return crc32(payload_of(record), crc32(record[:_CRC_OFFSET]))


def seal(record: np.ndarray, step: int, layout_hash: bytes) -> None:
    """Writes the header of ``record`` for ``step``, ending with the checksum of header and payload.

    Records are made only as fields leave RAM for a path (:meth:`TierStack.write`), so fields
    that live and die in the host cache never pay for the checksum (with zlib it was 40% of a
    cached update here).
    """
    fields = _HEADER.pack(_MAGIC, _VERSION, step, record.nbytes - HEADER_SIZE, layout_hash)
    record[:HEADER_SIZE] = 0
    record[: _HEADER.size] = np.frombuffer(fields, np.uint8)
    record[_CRC_OFFSET:HEADER_SIZE] = np.frombuffer(struct.pack("<I", _checksum(record)), np.uint8)


class Header(NamedTuple):
    """The decoded header of a record."""

    step: int
    payload_nbytes: int
    layout_hash: bytes
    checksum: int


def read_header(record: np.ndarray, name: str) -> Header:
    """Decodes a record's header; raises RecordError naming ``name`` when it is not one."""
    if record.nbytes < HEADER_SIZE:
        raise RecordError(f"record {name} is truncated ({record.nbytes} bytes, less than its header)")
    magic, version, step, nbytes, layout_hash = _HEADER.unpack(record[: _HEADER.size].tobytes())
    (checksum,) = struct.unpack("<I", record[_CRC_OFFSET:HEADER_SIZE].tobytes())
    if magic != _MAGIC or version != _VERSION:
        raise RecordError(f"record {name} has no jax_mlp header: it is not a jax_mlp record or it was never written")
    return Header(step, nbytes, layout_hash, checksum)


def verify(record: np.ndarray, *, name: str, step: int, layout_hash: bytes) -> np.ndarray:
    """Checks a record read back from storage and returns its payload.

    Raises:
      RecordError: naming the record, when the header, size, checksum, layout hash or step is wrong.
    """
    header = read_header(record, name)
    remedy = "restore the last checkpoint, or resume from the tiers at the last complete step"
    if header.payload_nbytes != record.nbytes - HEADER_SIZE:
        raise RecordError(
            f"record {name} is truncated: {record.nbytes - HEADER_SIZE} of {header.payload_nbytes} bytes; {remedy}"
        )
    if _checksum(record) != header.checksum:
        raise RecordError(f"record {name} fails its checksum: it is corrupt or torn; {remedy}")
    if header.layout_hash != layout_hash:
        raise RecordError(
            f"record {name} belongs to another run or subgroup layout (layout hash {header.layout_hash.hex()}, "
            f"expected {layout_hash.hex()}); use a fresh directory or the same params, optimizer and subgroup_size"
        )
    if header.step != step:
        raise RecordError(f"record {name} holds step {header.step}, expected step {step}; {remedy}")
    return payload_of(record)


class RecordCodec(NamedTuple):
    """How a subgroup's fields become a sealed record and back; the tiers never look inside fields.

    Attributes:
      pack: ``pack(subgroup, fields, step)`` returns a sealed record of ``fields`` at ``step``.
      unpack: ``unpack(subgroup, payload)`` returns the fields a verified payload holds.
    """

    pack: Callable[[int, Any, int], np.ndarray]
    unpack: Callable[[int, np.ndarray], Any]


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


_TENSORSTORE_ERRNO = re.compile(r"os_error_code='(\d+)'")


def _errno_of(error: BaseException) -> int | None:
    """The OS error number of an OSError, or the one tensorstore quotes in its message."""
    if isinstance(error, OSError) and error.errno:
        return error.errno
    match = _TENSORSTORE_ERRNO.search(str(error))
    return int(match.group(1)) if match else None


def _describe_os_error(path: str, error: BaseException) -> str:
    text, number = str(error), _errno_of(error)
    if number == errno.ENOSPC or "No space left" in text:
        return f"path {path} is full (no space left on device); free space there or give another path"
    if number == errno.EROFS:
        return f"path {path} is not writable (a read-only file system); remount it read-write or give another path"
    if number in (errno.EACCES, errno.EPERM) or "ermission" in text:
        return f"path {path} is not writable; fix its permissions or give another path"
    if number == errno.ENOENT or "NOT_FOUND" in text or "No such file" in text:
        return f"path {path} is gone (a file or directory vanished); restore it or give another path"
    return f"I/O on path {path} failed: {text.splitlines()[0] if text else type(error).__name__}"


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
        self.intervals: collections.deque[tuple[str, float, float]] = collections.deque(maxlen=4096)

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
                self.intervals.append((kind, started, ended))

    def take_usage(self) -> Usage:
        """The usage since the previous call (transfers still running count in the next)."""
        with self._lock:
            usage, self._usage = self._usage, Usage(0, 0, 0.0)
            if self._active:
                now = time.monotonic()
                usage = usage._replace(busy_seconds=usage.busy_seconds + now - self._busy_since)
                self._busy_since = now
            return usage


class _Requests:
    """Chunk transfers of one record in flight on a pool; ``result`` waits for all, then raises the first error."""

    def __init__(self, futures: list[concurrent.futures.Future], value: Any = None):
        self._futures, self._value = futures, value

    def result(self) -> Any:
        concurrent.futures.wait(self._futures)
        for future in self._futures:
            future.result()
        return self._value


def _allows_direct_io(name: str) -> bool:
    """Whether the file system of the existing file ``name`` accepts O_DIRECT (tmpfs, for one, does not)."""
    try:
        os.close(os.open(name, os.O_RDONLY | os.O_DIRECT))
    except OSError as error:
        if error.errno == errno.EINVAL:
            return False
        raise
    return True


class ChunkFiles:
    """One record's zarr3 array on a local file system, moved chunk file by chunk file.

    Each chunk file ``c/<i>`` is written with ``os.pwrite`` in place and read with ``os.preadv``,
    all of a record's chunks at once on the path's request pool. With ``direct`` (the file system
    allows O_DIRECT, the chunks are block-aligned) the bytes go between the disk and the record's
    own buffer, with no page-cache copy: through tensorstore, buffered, the same records moved at
    a third of the disk's speed or less here, most of it page faults on fresh buffers. The files are
    exactly tensorstore's (full-size edge chunks), so tensorstore reads them too. It duck-types
    the part of ``ts.TensorStore`` that :class:`PathStore` uses: ``shape``, ``write``, ``read``.

    Args:
      directory: the record's array directory (holding ``zarr.json``).
      nbytes: the record's size.
      chunk: the array's chunk size.
      pools: the thread pools that run the chunk reads and the chunk writes, in that order.
      direct: whether the path allows O_DIRECT.
    """

    def __init__(
        self, directory: str, nbytes: int, chunk: int, pools: tuple[concurrent.futures.Executor, ...], direct: bool
    ):
        self.directory = directory
        self.shape = (nbytes,)
        self.chunk = chunk
        self._readers, self._writers = pools
        self._direct = direct and chunk % ALIGNMENT == 0
        self._count = -(-nbytes // chunk)

    def _chunk_file(self, index: int) -> str:
        return os.path.join(self.directory, "c", str(index))

    def _stored(self, record: np.ndarray) -> np.ndarray:
        """``record`` padded to whole chunks: its own buffer when that reaches whole chunks (a
        :func:`new_record` does, padded with zeros), else a zero-padded copy."""
        stored = self._count * self.chunk
        base = record.base
        if isinstance(base, np.ndarray) and base.dtype == np.uint8 and base.ndim == 1 and base.flags.c_contiguous:
            offset = record.ctypes.data - base.ctypes.data
            aligned = record.ctypes.data % ALIGNMENT == 0 or not self._direct
            if aligned and 0 <= offset <= base.nbytes - stored:
                return base[offset : offset + stored]
        padded = aligned_buffer(stored)
        padded[: record.nbytes] = record
        return padded

    def _open(self, index: int, flags: int) -> int:
        return os.open(self._chunk_file(index), flags | (os.O_DIRECT if self._direct else 0), 0o644)

    def _write_chunk(self, index: int, data: np.ndarray) -> None:
        fd = self._open(index, os.O_WRONLY | os.O_CREAT)
        try:
            view, done = memoryview(data), 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], done)
        finally:
            os.close(fd)

    def _read_chunk(self, index: int, out: np.ndarray) -> None:
        fd = self._open(index, os.O_RDONLY)
        try:
            view, done = memoryview(out), 0
            while done < len(view):
                got = os.preadv(fd, [view[done:]], done)
                if got == 0 or (self._direct and got % ALIGNMENT):  # O_DIRECT reads fall short only at the end
                    raise OSError(errno.EIO, f"{done + got} bytes, expected {len(view)}", self._chunk_file(index))
                done += got
        finally:
            os.close(fd)

    def _each_chunk(
        self, pool: concurrent.futures.Executor, transfer, buffer: np.ndarray, value: Any = None
    ) -> _Requests:
        chunk = self.chunk
        futures = [pool.submit(transfer, i, buffer[i * chunk : (i + 1) * chunk]) for i in range(self._count)]
        return _Requests(futures, value)

    def write(self, record: np.ndarray) -> _Requests:
        """Starts writing the whole record; ``result()`` of the returned object waits for it.

        Chunks are rewritten in place, which needs no new space, so a full file system would go
        unnoticed until a file must be created (a moved subgroup, ``run.json``). A file system with
        less than a block free is therefore refused now, while the previous step is intact.
        """
        os.makedirs(os.path.join(self.directory, "c"), exist_ok=True)
        if shutil.disk_usage(self.directory).free < ALIGNMENT:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.directory)
        return self._each_chunk(self._writers, self._write_chunk, self._stored(record))

    def read(self) -> _Requests:
        """Starts reading the whole record into a new aligned buffer; ``result()`` returns it."""
        stored = aligned_buffer(self._count * self.chunk, zeroed=False)
        return self._each_chunk(self._readers, self._read_chunk, stored, stored[: self.shape[0]])


class PathStore:
    """One storage path: records as zarr3 arrays in ``root/proc{process_index}``.

    All methods block and are meant to run on the engine's I/O threads. tensorstore creates and
    checks each record's ``zarr.json``; :class:`ChunkFiles` moves its chunks, ``CHUNK_REQUESTS``
    at a time, on a pool of this path's own.
    """

    def __init__(self, root: str, process_index: int = 0, traffic: Traffic | None = None):
        self.root = root
        self.directory = os.path.join(root, f"proc{process_index:04d}")
        self.traffic = traffic or Traffic()
        self._context = ts.Context({"file_io_sync": False})
        self._arrays: dict[tuple[int, int], Any] = {}
        self._lock = threading.Lock()
        self._has_run_file = False  # once it has, losing it means the directory vanished
        self._direct = False
        self._ensure_writable()
        self._chunk_pools = tuple(
            concurrent.futures.ThreadPoolExecutor(CHUNK_REQUESTS, thread_name_prefix=f"jax_mlp-chunk-{kind}")
            for kind in ("read", "write")
        )

    def _ensure_writable(self) -> None:
        try:
            os.makedirs(self.directory, exist_ok=True)
            probe = os.path.join(self.directory, ".write_probe")
            with open(probe, "wb") as f:
                f.write(b"0")
            self._direct = _allows_direct_io(probe)
            os.remove(probe)
        except OSError as error:
            if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise PathError(
                    f"path {self.root} is not writable; fix its permissions or give another path"
                ) from error
            raise PathError(
                f"path {self.root} cannot be created or used ({error.strerror}); create it or give another path"
            ) from error

    def _record_kvstore(self, name: str) -> dict:
        return {"driver": "file", "path": os.path.join(self.directory, name)}

    def _spec(self, name: str, nbytes: int | None) -> dict:
        # Every chunk is stored, zeros too, so a missing chunk is damage: reading it fails, never gives zeros.
        spec: dict[str, Any] = {
            "driver": "zarr3",
            "kvstore": self._record_kvstore(name),
            "store_data_equal_to_fill_value": True,
            "fill_missing_data_reads": False,
        }
        if nbytes is not None:
            spec["metadata"] = {
                "shape": [nbytes],
                "data_type": "uint8",
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [chunk_bytes(nbytes)]}},
                "codecs": [{"name": "bytes"}],
                "fill_value": 0,
            }
        return spec

    def _array(self, subgroup: int, slot: int, nbytes: int | None, *, create: bool) -> Any:
        key = (subgroup, slot)
        with self._lock:
            array = self._arrays.get(key)
        if array is not None and (nbytes is None or array.shape[0] == nbytes):
            return array
        spec = self._spec(record_name(subgroup, slot), nbytes)
        try:
            array = ts.open(spec, create=create, open=True, context=self._context).result()
        except ValueError:
            if not create:
                raise
            # The slot holds a damaged or foreign array: it is about to be rewritten whole anyway.
            array = ts.open(spec, create=True, delete_existing=True, context=self._context).result()
        array = self._mover(array, record_name(subgroup, slot))
        with self._lock:
            self._arrays[key] = array
        return array

    def _mover(self, array: Any, name: str) -> Any:
        """What moves the record's bytes: :class:`ChunkFiles` for a plain uint8 zarr3 array, else tensorstore."""
        plain = (
            array.rank == 1 and array.dtype == ts.uint8 and array.codec.to_json().get("codecs") == [{"name": "bytes"}]
        )
        if not plain:
            return array
        chunk = array.chunk_layout.read_chunk.shape[0]
        directory = os.path.join(self.directory, name)
        return ChunkFiles(directory, array.shape[0], chunk, self._chunk_pools, self._direct)

    def write(self, subgroup: int, slot: int, record: np.ndarray) -> None:
        """Writes a whole sealed record to its slot; raises PathError naming this path."""
        name = os.path.join(self.directory, record_name(subgroup, slot))
        try:
            if self._is_gone():  # tensorstore would silently recreate the directories
                raise FileNotFoundError(errno.ENOENT, "the directory vanished", self.directory)
            array = self._array(subgroup, slot, record.nbytes, create=True)
            with self.traffic.transfer("write", record.nbytes):
                array.write(record).result()
        except Exception as error:  # tensorstore raises ValueError and OSError-like errors
            raise PathError(f"writing record {name}: {_describe_os_error(self.root, error)}") from error

    def read(self, subgroup: int, slot: int) -> np.ndarray:
        """Reads a whole record back into a new buffer; raises RecordError if it is missing."""
        name = os.path.join(self.directory, record_name(subgroup, slot))
        try:
            array = self._array(subgroup, slot, None, create=False)
            with self.traffic.transfer("read", array.shape[0]):
                return array.read().result()
        except Exception as error:
            if self._is_gone():
                raise PathError(f"reading record {name}: {_describe_os_error(self.root, error)}") from error
            raise RecordError(
                f"record {name} is missing or unreadable ({str(error).splitlines()[0]}); restore the last "
                "checkpoint, or resume from the tiers at the last complete step"
            ) from error

    def verified_step(self, subgroup: int, slot: int, layout_hash: bytes) -> int | None:
        """The step of the record in ``slot`` if it exists and passes every check, else None."""
        name = os.path.join(self.directory, record_name(subgroup, slot))
        if not self._has_record(name):
            return None
        try:
            record = self.read(subgroup, slot)
            step = read_header(record, name).step
            verify(record, name=name, step=step, layout_hash=layout_hash)
        except RecordError:
            return None
        return step

    def _has_record(self, name: str) -> bool:
        return os.path.exists(os.path.join(name, "zarr.json"))

    def delete(self, subgroup: int) -> None:
        """Removes both slots of ``subgroup`` from this path (after it moved to another one)."""
        for slot in (0, 1):
            with self._lock:
                self._arrays.pop((subgroup, slot), None)
            self._delete_record(record_name(subgroup, slot))

    def _delete_record(self, name: str) -> None:
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def _is_gone(self) -> bool:
        """Whether the directory vanished: it is missing, or it lost the run file it held."""
        if not os.path.isdir(self.directory):
            return True
        return self._has_run_file and not os.path.exists(os.path.join(self.directory, RUN_FILE))

    def read_run_file(self) -> dict | None:
        try:
            with open(os.path.join(self.directory, RUN_FILE)) as f:
                content = json.load(f)
        except FileNotFoundError:
            return None
        self._has_run_file = True
        return content

    def write_run_file(self, content: dict) -> None:
        """Writes the run's identity atomically (write, fsync, rename)."""
        final = os.path.join(self.directory, RUN_FILE)
        temporary = final + ".tmp"
        try:
            with open(temporary, "w") as f:
                json.dump(content, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, final)
        except OSError as error:
            raise PathError(f"writing {final}: {_describe_os_error(self.root, error)}") from error
        self._has_run_file = True

    def remove(self) -> None:
        """Deletes this process's directory on the path, and the path itself if then empty."""
        shutil.rmtree(self.directory, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(self.root)


class KvStorePath(PathStore):
    """A storage path given as a tensorstore kvstore spec (object storage, memory, ...).

    Records live under ``<spec path>proc{process_index}/``; the run file is a key there. A spec
    is opened in one tensorstore context, so a ``memory`` store lives as long as this object.
    """

    def __init__(self, spec: dict, process_index: int = 0, traffic: Traffic | None = None):
        self.traffic = traffic or Traffic()
        self._base = dict(spec)
        prefix = self._base.get("path", "")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        self._prefix = f"{prefix}proc{process_index:04d}/"
        self.root = f"{self._base['driver']}://{prefix}"
        self.directory = f"{self._base['driver']}://{self._prefix}"
        self._context = ts.Context({"file_io_sync": False})
        self._arrays = {}
        self._lock = threading.Lock()
        try:
            self._kvstore = ts.KvStore.open({**self._base, "path": self._prefix}, context=self._context).result()
        except Exception as error:
            raise PathError(f"path {self.root} cannot be opened as a tensorstore kvstore: {error}") from error
        self._ensure_writable()

    def _ensure_writable(self) -> None:
        try:
            self._kvstore.write(".write_probe", b"0").result()
            self._kvstore.delete_range(ts.KvStore.KeyRange(".write_probe", ".write_probe\0")).result()
        except Exception as error:
            raise PathError(f"writing {self.directory}: {_describe_os_error(self.root, error)}") from error

    def _record_kvstore(self, name: str) -> dict:
        return {**self._base, "path": f"{self._prefix}{name}/"}

    def _mover(self, array: Any, name: str) -> Any:
        return array  # tensorstore moves the bytes of any kvstore

    def _has_record(self, name: str) -> bool:
        return True  # a missing record fails its read, which verified_step treats as absent

    def _delete_record(self, name: str) -> None:
        self._kvstore.delete_range(ts.KvStore.KeyRange(f"{name}/", f"{name}0")).result()

    def _is_gone(self) -> bool:
        return False  # a kvstore has no directory to vanish; a failed read is a missing record

    def read_run_file(self) -> dict | None:
        value = self._kvstore.read(RUN_FILE).result()
        return json.loads(value.value) if value.state == "value" else None

    def write_run_file(self, content: dict) -> None:
        try:
            self._kvstore.write(RUN_FILE, json.dumps(content).encode()).result()
        except Exception as error:
            raise PathError(f"writing {self.directory}{RUN_FILE}: {_describe_os_error(self.root, error)}") from error

    def remove(self) -> None:
        self._kvstore.delete_range(ts.KvStore.KeyRange()).result()


def open_path(path: Path, process_index: int = 0, *, max_inflight: int = 4, node_lock: str | None = None) -> PathStore:
    """The store for one configured path, a local directory or a tensorstore kvstore spec.

    Args:
      path: the path, with its caps.
      process_index: this process's index (its records go to ``proc{index}``).
      max_inflight: transfers in flight at once on the path.
      node_lock: a node-local directory for cross-process path locks, or None for no lock.

    Returns:
      The store, with its traffic control in place.
    """
    lock_file = None
    if node_lock is not None:
        os.makedirs(node_lock, exist_ok=True)
        digest = hashlib.sha256(path.identity.encode()).hexdigest()[:24]
        lock_file = os.path.join(node_lock, f"{digest}.lock")
    traffic = Traffic(max_inflight, lock_file, path.max_read, path.max_write)
    if isinstance(path.location, dict):
        return KvStorePath(path.location, process_index, traffic)
    return PathStore(path.location, process_index, traffic)


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
