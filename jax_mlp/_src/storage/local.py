"""The local backend: a path's run directory on one of this machine's file systems.

tensorstore creates and checks each record's ``zarr.json``; :class:`ChunkFiles` moves its chunks,
``CHUNK_REQUESTS`` at a time on a pool of this directory's own, with O_DIRECT where the file system
allows. One writer holds the directory (:class:`RunLock`), and a directory that vanished under it
is told apart from a missing record.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import shutil
import threading

import tensorstore as ts

from jax_mlp._src.errors import PathError
from jax_mlp._src.storage.backend import RUN_FILE, RecordArray, Room, describe_os_error, open_zarr3, zarr3_spec
from jax_mlp._src.storage.chunk_files import CHUNK_REQUESTS, ChunkFiles, allows_direct_io
from jax_mlp._src.storage.ownership import RunLock


def room(directory: str) -> Room:
    """The free space of ``directory``'s file system."""
    stats = os.statvfs(directory)
    return Room(stats.f_bavail * stats.f_frsize, stats.f_frsize, os.stat(directory).st_dev)


class LocalBackend:
    """A :class:`~jax_mlp._src.storage.backend.Backend` in ``root/proc{process_index}``, a local directory.

    Args:
      root: the path's directory (created if missing).
      process_index: this process's index.

    Raises:
      PathError: the directory cannot be created or written.
    """

    def __init__(self, root: str, process_index: int = 0):
        self.root = root
        self.directory = os.path.join(root, f"proc{process_index:04d}")
        self._context = ts.Context({"file_io_sync": False})
        self._has_run_file = False  # once it has, losing it means the directory vanished
        self._run_lock: RunLock | None = None
        self._direct = self._ensure_writable()
        self._chunk_pools = tuple(
            concurrent.futures.ThreadPoolExecutor(CHUNK_REQUESTS, thread_name_prefix=f"jax_mlp-chunk-{kind}")
            for kind in ("read", "write")
        )

    def _ensure_writable(self) -> bool:
        """Creates the directory and writes a file there; returns whether its file system allows O_DIRECT."""
        try:
            os.makedirs(self.directory, exist_ok=True)
            probe = os.path.join(self.directory, f".write_probe.{os.getpid()}.{threading.get_ident()}")
            with open(probe, "wb") as f:
                f.write(b"0")
            direct = allows_direct_io(probe)
            os.remove(probe)
        except OSError as error:
            if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise PathError(
                    f"path {self.root} is not writable; fix its permissions or give another path"
                ) from error
            raise PathError(
                f"path {self.root} cannot be created or used ({error.strerror}); create it or give another path"
            ) from error
        return direct

    def open_record(self, name: str, nbytes: int | None, *, create: bool) -> RecordArray:
        kvstore = {"driver": "file", "path": os.path.join(self.directory, name)}
        array = open_zarr3(zarr3_spec(kvstore, nbytes), self._context, create=create)
        plain = (
            array.rank == 1 and array.dtype == ts.uint8 and array.codec.to_json().get("codecs") == [{"name": "bytes"}]
        )
        if not plain:
            return array  # not a record as written here: tensorstore moves its bytes
        chunk = array.chunk_layout.read_chunk.shape[0]
        return ChunkFiles(os.path.join(self.directory, name), array.shape[0], chunk, self._chunk_pools, self._direct)

    def has_record(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.directory, name, "zarr.json"))

    def delete_record(self, name: str) -> None:
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def vanished(self) -> bool:
        """Whether the directory is missing, or lost the run file it held (tensorstore would silently recreate it)."""
        if not os.path.isdir(self.directory):
            return True
        return self._has_run_file and not os.path.exists(os.path.join(self.directory, RUN_FILE))

    def path_failed(self, error: BaseException) -> bool:
        return self.vanished()  # an OS error of a record's read is the record's, unless the directory went

    def describe(self, error: BaseException) -> str:
        return describe_os_error(self.root, error)

    def read_run_file(self) -> bytes | None:
        try:
            with open(os.path.join(self.directory, RUN_FILE), "rb") as f:
                content = f.read()
        except FileNotFoundError:
            return None
        self._has_run_file = True
        return content

    def write_run_file(self, content: bytes) -> None:
        """Writes the run file atomically (write, fsync, rename)."""
        final = os.path.join(self.directory, RUN_FILE)
        temporary = final + ".tmp"
        with open(temporary, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, final)
        self._has_run_file = True

    def room(self) -> Room:
        return room(self.directory)

    def hold(self) -> None:
        """Takes the directory's :class:`RunLock`.

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
        lock, self._run_lock = self._run_lock, None
        if lock is not None:
            lock.release()

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(self.root)
