"""Tiers: a bounded host-RAM cache and tensorstore-backed storage paths, holding records.

A *record* is one subgroup's state at one step: a 64-byte header (magic, version, step, payload
size, layout hash, and a CRC-32 of the header and payload) followed by the raw payload. Each record is a zarr3 uint8 array with the
``bytes`` codec and 4 MiB chunks, written with ``file_io_sync`` off and many chunks in flight: the
fastest tensorstore layout measured here (see docs/architecture.md). Step ``s`` of subgroup ``k``
lives in slot ``s % 2``, so writing step ``s + 1`` never touches step ``s``.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import tensorstore as ts

from jax_mlp.config import Path

HEADER_SIZE = 64
CHUNK_BYTES = 4 * 1024**2
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


def new_record(payload_nbytes: int) -> np.ndarray:
    """A zeroed buffer for a record: header room plus payload."""
    return np.zeros(HEADER_SIZE + payload_nbytes, dtype=np.uint8)


def payload_of(record: np.ndarray) -> np.ndarray:
    """The payload part of a record buffer (a view)."""
    return record[HEADER_SIZE:]


def _checksum(record: np.ndarray) -> int:
    return zlib.crc32(payload_of(record), zlib.crc32(record[:_CRC_OFFSET]))


def seal(record: np.ndarray, step: int, layout_hash: bytes) -> None:
    """Writes the header of ``record`` for ``step``, ending with the checksum of header and payload."""
    fields = _HEADER.pack(_MAGIC, _VERSION, step, record.nbytes - HEADER_SIZE, layout_hash)
    record[:_CRC_OFFSET] = 0
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


class CacheEntry(NamedTuple):
    """A cached record: its buffer, the step it holds and whether storage lacks it."""

    record: np.ndarray
    step: int
    dirty: bool


class HostCache:
    """A bounded LRU cache of records in host RAM, keyed by subgroup index.

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
                self.nbytes -= old.record.nbytes
            evicted = []
            while self._entries and self.nbytes + entry.record.nbytes > self.capacity:
                victim_key, victim = self._entries.popitem(last=False)
                self.nbytes -= victim.record.nbytes
                evicted.append((victim_key, victim))
            self._entries[key] = entry
            self.nbytes += entry.record.nbytes
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
                self.nbytes -= self._entries.pop(key).record.nbytes

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


class PathStore:
    """One storage path: records as zarr3 arrays in ``root/proc{process_index}``.

    All methods block and are meant to run on the engine's I/O threads; tensorstore releases the
    GIL while it works.
    """

    def __init__(self, root: str, process_index: int = 0, traffic: Traffic | None = None):
        self.root = root
        self.directory = os.path.join(root, f"proc{process_index:04d}")
        self.traffic = traffic or Traffic()
        self._context = ts.Context({"file_io_sync": False})
        self._arrays: dict[tuple[int, int], Any] = {}
        self._lock = threading.Lock()
        self._has_run_file = False  # once it has, losing it means the directory vanished
        self._ensure_writable()

    def _ensure_writable(self) -> None:
        try:
            os.makedirs(self.directory, exist_ok=True)
            probe = os.path.join(self.directory, ".write_probe")
            with open(probe, "wb") as f:
                f.write(b"0")
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
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [min(nbytes, CHUNK_BYTES)]}},
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
        with self._lock:
            self._arrays[key] = array
        return array

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
    """The cache in front of the paths: fetch a subgroup's record at a step, store a new one.

    Where each subgroup's newest stored record lives is tracked in ``locations``; new records go
    to the path ``placement`` names. Dirty cached records reach storage on eviction or through
    :meth:`write_back`.

    Args:
      cache: the host cache (capacity 0 disables it).
      paths: the storage paths.
      layout_hash: the plan's hash, checked in every record read.
      placement: maps a subgroup index to the index of the path its next record goes to.
      counters: where bytes moved and cache hits are counted.
    """

    def __init__(self, cache: HostCache, paths: list[PathStore], layout_hash: bytes, placement, counters):
        self.cache = cache
        self.paths = paths
        self.layout_hash = layout_hash
        self.placement = placement
        self.counters = counters
        self.locations: dict[int, int] = {}
        self.moved: list[tuple[int, int]] = []
        self.pins: list[Pin] = []

    def pin(self, step: int, timeout: float) -> Pin:
        """Pins ``step`` for a reader beside training; call it only when ``step`` is complete on storage."""
        pin = Pin(step, self.locations, timeout)
        self.pins = [p for p in self.pins if not p.released] + [pin]
        return pin

    def read_pinned(self, pin: Pin, subgroup: int) -> np.ndarray:
        """The payload of ``subgroup`` at the pinned step, verified, then unpinned; not counted in the stats.

        It comes from the cache while the cache still holds that step, else from storage.
        """
        entry = self.cache.peek(subgroup)
        if entry is not None and entry.step == pin.step:
            record, name = entry.record, f"cached record of subgroup {subgroup}"
        else:
            path = self.paths[pin.locations[subgroup]]
            record = path.read(subgroup, pin.step % 2)
            name = os.path.join(path.directory, record_name(subgroup, pin.step % 2))
        payload = verify(record, name=name, step=pin.step, layout_hash=self.layout_hash)
        pin.mark_read(subgroup)
        return payload

    def fetch(self, subgroup: int, step: int) -> np.ndarray:
        """The payload of ``subgroup`` at ``step``, from the cache or its path (verified)."""
        entry = self.cache.get(subgroup)
        if entry is not None and entry.step == step:
            self.counters.hit()
            return payload_of(entry.record)
        path = self.paths[self.locations.get(subgroup, self.placement(subgroup))]
        started = time.perf_counter()
        record = path.read(subgroup, step % 2)
        self.counters.read(path.root, record.nbytes, subgroup=subgroup, started=started)
        name = os.path.join(path.directory, record_name(subgroup, step % 2))
        return verify(record, name=name, step=step, layout_hash=self.layout_hash)

    def write(self, subgroup: int, record: np.ndarray, step: int) -> None:
        """Writes a sealed record of ``step`` to the path the placement picks."""
        index = self.placement(subgroup)
        for pin in self.pins:
            if pin.blocks(subgroup, index, step % 2):
                pin.wait(subgroup)
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

    def store(self, subgroup: int, record: np.ndarray, step: int) -> None:
        """Keeps a sealed record in the cache when it fits (writing back what that evicts), else writes it."""
        if not self.cache.fits(record.nbytes):
            self.write(subgroup, record, step)
            return
        for victim, entry in self.cache.put(subgroup, CacheEntry(record, step, dirty=True)):
            if entry.dirty:
                self.write(victim, entry.record, entry.step)

    def write_back(self, subgroup: int, entry: CacheEntry) -> None:
        """Writes a dirty cached record to storage and marks it clean."""
        self.write(subgroup, entry.record, entry.step)
        self.cache.mark_clean(subgroup, entry.step)
