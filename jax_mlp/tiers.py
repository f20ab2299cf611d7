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
import json
import os
import shutil
import struct
import threading
import zlib
from typing import Any, NamedTuple

import numpy as np
import tensorstore as ts

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


def _describe_os_error(path: str, error: BaseException) -> str:
    text = str(error)
    if (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "No space left" in text:
        return f"path {path} is full (no space left on device); free space there or give another path"
    if (isinstance(error, OSError) and error.errno in (errno.EACCES, errno.EPERM, errno.EROFS)) or "ermission" in text:
        return f"path {path} is not writable; fix its permissions or give another path"
    if (isinstance(error, OSError) and error.errno == errno.ENOENT) or "NOT_FOUND" in text or "No such file" in text:
        return f"path {path} is gone (a file or directory vanished); restore it or give another path"
    return f"I/O on path {path} failed: {text.splitlines()[0] if text else type(error).__name__}"


class PathStore:
    """One storage path: records as zarr3 arrays in ``root/proc{process_index}``.

    All methods block and are meant to run on the engine's I/O threads; tensorstore releases the
    GIL while it works.
    """

    def __init__(self, root: str, process_index: int = 0):
        self.root = root
        self.directory = os.path.join(root, f"proc{process_index:04d}")
        self._context = ts.Context({"file_io_sync": False})
        self._arrays: dict[tuple[int, int], Any] = {}
        self._lock = threading.Lock()
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
        spec: dict[str, Any] = {"driver": "zarr3", "kvstore": self._record_kvstore(name)}
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
        array = ts.open(spec, create=create, open=True, context=self._context).result()
        with self._lock:
            self._arrays[key] = array
        return array

    def write(self, subgroup: int, slot: int, record: np.ndarray) -> None:
        """Writes a whole sealed record to its slot; raises PathError naming this path."""
        name = os.path.join(self.directory, record_name(subgroup, slot))
        try:
            array = self._array(subgroup, slot, record.nbytes, create=True)
            array.write(record).result()
        except Exception as error:  # tensorstore raises ValueError and OSError-like errors
            raise PathError(f"writing record {name}: {_describe_os_error(self.root, error)}") from error

    def read(self, subgroup: int, slot: int) -> np.ndarray:
        """Reads a whole record back into a new buffer; raises RecordError if it is missing."""
        name = os.path.join(self.directory, record_name(subgroup, slot))
        try:
            array = self._array(subgroup, slot, None, create=False)
            return array.read().result()
        except Exception as error:
            if self._is_gone():
                raise PathError(f"reading record {name}: {_describe_os_error(self.root, error)}") from error
            raise RecordError(f"record {name} is missing or unreadable ({str(error).splitlines()[0]})") from error

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

    def _is_gone(self) -> bool:
        return not os.path.isdir(self.directory)

    def read_run_file(self) -> dict | None:
        try:
            with open(os.path.join(self.directory, RUN_FILE)) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

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

    def __init__(self, spec: dict, process_index: int = 0):
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


def open_path(path: str | dict, process_index: int = 0) -> PathStore:
    """The store for one configured path: a local directory, or a tensorstore kvstore spec."""
    return KvStorePath(path, process_index) if isinstance(path, dict) else PathStore(path, process_index)


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

    def fetch(self, subgroup: int, step: int) -> np.ndarray:
        """The payload of ``subgroup`` at ``step``, from the cache or its path (verified)."""
        entry = self.cache.get(subgroup)
        if entry is not None and entry.step == step:
            self.counters.hit()
            return payload_of(entry.record)
        path = self.paths[self.locations.get(subgroup, self.placement(subgroup))]
        record = path.read(subgroup, step % 2)
        self.counters.read(path.root, record.nbytes)
        name = os.path.join(path.directory, record_name(subgroup, step % 2))
        return verify(record, name=name, step=step, layout_hash=self.layout_hash)

    def write(self, subgroup: int, record: np.ndarray, step: int) -> None:
        """Writes a sealed record of ``step`` to the path the placement picks."""
        index = self.placement(subgroup)
        self.paths[index].write(subgroup, step % 2, record)
        self.counters.wrote(self.paths[index].root, record.nbytes)
        self.locations[subgroup] = index

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
