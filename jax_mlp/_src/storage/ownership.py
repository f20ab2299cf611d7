"""One live writer per run directory: an exclusive ``flock`` held from ``init`` to ``close``.

Each process's run directory on a path (``PATH/proc0000``) holds a lock file, ``writer.lock``. The
writer takes ``fcntl.flock(LOCK_EX | LOCK_NB)`` on it and writes its pid and host to
``writer.json`` beside it, so a second writer is refused with a message that names the holder. The
operating system releases a flock with the last file descriptor of its holder, so a writer killed
with ``kill -9`` leaves no stale lock. A set of held directories guards the same process too: there
a second flock conflicts on a local file system, but not on NFS, where the kernel emulates flock
with per-process locks. The lock file is open read-only where the file system allows (NFS wants it
writable), so the path can still be remounted read-only under a running writer.

A file system that has no locks (Lustre mounted without ``flock``, NFS without a lock manager) is
logged as a warning and keeps only the in-process guard.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import threading

from jax_mlp._src.errors import PathInUseError

LOCK_FILE = "writer.lock"
HOLDER_FILE = "writer.json"

logger = logging.getLogger(__name__)

_HELD: set[str] = set()  # run directories (real paths) held in this process
_HELD_GUARD = threading.Lock()
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def _holder_text(holder: dict | None) -> str:
    if not holder:
        return "a writer that is just starting"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, since {holder.get('since')}"


class RunLock:
    """The exclusive hold of one run directory by this writer.

    Args:
      directory: the run directory (it exists).
      path: the configured path, for messages.
    """

    def __init__(self, directory: str, path: str):
        self.directory = directory
        self.path = path
        self.lock_file = os.path.join(directory, LOCK_FILE)
        self.holder_file = os.path.join(directory, HOLDER_FILE)
        self._key = os.path.realpath(directory)
        self._fd: int | None = None
        self._held = False

    def acquire(self) -> None:
        """Holds the directory, or raises :class:`PathInUseError` naming its holder.

        Raises:
          PathInUseError: another writer, in this process or another one, holds the directory.
          OSError: the lock file cannot be created (the caller names the path).
        """
        with _HELD_GUARD:
            if self._key in _HELD:
                raise PathInUseError(
                    f"path {self.path} is in use: its run directory {self.directory} is held by another "
                    f"mlp_offload in this process (pid {os.getpid()} on host {socket.gethostname()}); close() "
                    "that one first (then resume=True continues its run), or give another path"
                )
            _HELD.add(self._key)
        self._held = True
        try:
            self._fd = self._lock_file()
        except BaseException:
            self.release()
            raise

    def _lock_file(self) -> int | None:
        """Takes the flock on the lock file as it is on disk, writes the holder file; None without locks."""
        mode = os.O_RDONLY
        while True:
            fd = os.open(self.lock_file, mode | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(fd)
                if error.errno == errno.EBADF and mode == os.O_RDONLY:
                    mode = os.O_RDWR  # NFS emulates flock with a POSIX write lock, which wants a writable file
                    continue
                if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise PathInUseError(
                        f"path {self.path} is in use: its run directory {self.directory} is held by another "
                        f"mlp_offload ({_holder_text(self._holder())}), and two writers would overwrite each "
                        "other's records; stop that process or wait for it to close, then pass resume=True to "
                        "continue the run, or give another path"
                    ) from None
                if error.errno in _NO_LOCKS:
                    logger.warning(
                        "the file system of path %s has no file locks (%s): a second process writing to %s "
                        "is not refused; mount it with locking (Lustre: -o flock) to have it refused",
                        self.path,
                        error.strerror,
                        self.directory,
                    )
                    return None
                raise
            if _same_file(fd, self.lock_file):
                break
            os.close(fd)  # the file was removed (a close(delete=True)) after we opened it: lock the new one
        try:
            self._write_holder()
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _write_holder(self) -> None:
        """Writes who holds the directory, atomically, flushed for a contender on another node."""
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        temporary = f"{self.holder_file}.{os.getpid()}.tmp"
        with open(temporary, "w") as f:
            json.dump(holder, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, self.holder_file)

    def _holder(self) -> dict | None:
        try:
            with open(self.holder_file) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None  # not written yet, or already removed

    def release(self) -> None:
        """Lets go of the directory (removes the holder file first); does nothing if not held."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):  # a removed or read-only directory: the lock goes anyway
                os.remove(self.holder_file)
            os.close(fd)  # closing the last descriptor releases the flock
        if self._held:
            self._held = False
            with _HELD_GUARD:
                _HELD.discard(self._key)


def _same_file(fd: int, name: str) -> bool:
    try:
        on_disk = os.stat(name)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)
