"""Storage paths: records as zarr3 arrays in a local directory (:class:`PathStore`) or any tensorstore kvstore.

Each process keeps its records in ``proc{process_index}`` of a path, with the run's identity in
``run.json`` beside them. A writer holds that directory (:meth:`PathStore.hold`, see
:mod:`~jax_mlp.storage.ownership`) from ``init`` to ``close``. Every method blocks and is meant for
the engine's I/O threads; every error names the path and says what to do.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from jax_mlp.config import Path
from jax_mlp.errors import PathError, RecordError
from jax_mlp.storage.chunk_files import CHUNK_REQUESTS, ChunkFiles, allows_direct_io
from jax_mlp.storage.ownership import RunLock
from jax_mlp.storage.record import chunk_bytes, read_header, record_name, verify
from jax_mlp.storage.traffic import Traffic

RUN_FILE = "run.json"

_TENSORSTORE_ERRNO = re.compile(r"os_error_code='(\d+)'")


def _errno_of(error: BaseException) -> int | None:
    """The OS error number of an OSError, or the one tensorstore quotes in its message."""
    if isinstance(error, OSError) and error.errno:
        return error.errno
    match = _TENSORSTORE_ERRNO.search(str(error))
    return int(match.group(1)) if match else None


def describe_os_error(path: str, error: BaseException) -> str:
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


class PathStore:
    """One storage path: records as zarr3 arrays in ``root/proc{process_index}``.

    All methods block and are meant to run on the engine's I/O threads. tensorstore creates and
    checks each record's ``zarr.json``; :class:`ChunkFiles` moves its chunks, ``CHUNK_REQUESTS``
    at a time, on a pool of this path's own.
    """

    is_local = True  # a directory of this machine's file systems: locked, and its free space checked
    _run_lock: RunLock | None = None

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
            probe = os.path.join(self.directory, f".write_probe.{os.getpid()}.{threading.get_ident()}")
            with open(probe, "wb") as f:
                f.write(b"0")
            self._direct = allows_direct_io(probe)
            os.remove(probe)
        except OSError as error:
            if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise PathError(
                    f"path {self.root} is not writable; fix its permissions or give another path"
                ) from error
            raise PathError(
                f"path {self.root} cannot be created or used ({error.strerror}); create it or give another path"
            ) from error

    def hold(self) -> None:
        """Holds this process's run directory for this writer until :meth:`release`.

        Raises:
          PathInUseError: another writer holds it (the message names its pid and host).
          PathError: the lock file cannot be created.
        """
        lock = RunLock(self.directory, self.root)
        try:
            lock.acquire()
        except OSError as error:
            raise PathError(f"locking {lock.lock_file}: {describe_os_error(self.root, error)}") from error
        self._run_lock = lock

    def release(self) -> None:
        """Lets go of the run directory (after ``close``, or a failed ``init``); does nothing if not held."""
        lock, self._run_lock = self._run_lock, None
        if lock is not None:
            lock.release()

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
            raise PathError(f"writing record {name}: {describe_os_error(self.root, error)}") from error

    def read(self, subgroup: int, slot: int) -> np.ndarray:
        """Reads a whole record back into a new buffer; raises RecordError if it is missing."""
        name = os.path.join(self.directory, record_name(subgroup, slot))
        try:
            array = self._array(subgroup, slot, None, create=False)
            with self.traffic.transfer("read", array.shape[0]):
                return array.read().result()
        except Exception as error:
            if self._is_gone():
                raise PathError(f"reading record {name}: {describe_os_error(self.root, error)}") from error
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
            raise PathError(f"writing {final}: {describe_os_error(self.root, error)}") from error
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
    A kvstore has no file lock and no free-space figure: it is neither held nor checked.
    """

    is_local = False

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
            raise PathError(f"writing {self.directory}: {describe_os_error(self.root, error)}") from error

    def hold(self) -> None:
        pass  # object stores have no lock that the OS releases when its holder dies

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
            raise PathError(f"writing {self.directory}{RUN_FILE}: {describe_os_error(self.root, error)}") from error

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


def open_paths(
    paths: Sequence[Path], process_index: int = 0, *, max_inflight: int = 4, node_lock: str | None = None
) -> list[PathStore]:
    """Opens every configured path and holds its run directory for this writer.

    Args:
      paths: the configured paths.
      process_index: this process's index.
      max_inflight: transfers in flight at once on each path.
      node_lock: a node-local directory for cross-process path locks, or None for no lock.

    Returns:
      The stores, each held until its :meth:`~PathStore.release`.

    Raises:
      PathInUseError: a path's run directory is held by another writer; the paths held so far are released.
      PathError: a path cannot be opened; the paths held so far are released.
    """
    opened: list[PathStore] = []
    try:
        for path in paths:
            opened.append(open_path(path, process_index, max_inflight=max_inflight, node_lock=node_lock))
            opened[-1].hold()
    except BaseException:
        release_paths(opened)
        raise
    return opened


def release_paths(paths: Sequence[PathStore]) -> None:
    """Lets go of every path's run directory (see :func:`open_paths`)."""
    for path in paths:
        path.release()
