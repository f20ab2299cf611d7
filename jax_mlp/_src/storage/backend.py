"""What a storage backend is, and what the two backends share.

A backend is one process's run directory on a path: records by key, the run file, free space and
the writer's hold. :class:`~jax_mlp._src.storage.paths.PathStore` composes one with its traffic control
and owns what every backend shares. Two backends exist side by side: a directory of this machine
(:class:`~jax_mlp._src.storage.local.LocalBackend`) and any tensorstore kvstore
(:class:`~jax_mlp._src.storage.kvstore.KvStoreBackend`). Both keep each record as a zarr3 ``uint8`` array
(:func:`zarr3_spec`) and the run's identity in ``run.json``.
"""

from __future__ import annotations

import errno
import re
from typing import Any, NamedTuple, Protocol

import numpy as np
import tensorstore as ts

from jax_mlp._src.storage.record import chunk_bytes

RUN_FILE = "run.json"

_TENSORSTORE_ERRNO = re.compile(r"os_error_code='(\d+)'")


class Room(NamedTuple):
    """A directory's file system, as the capacity check sees it.

    Attributes:
      free: bytes free to this user.
      block: the file system's block size.
      device: the file system's id (``st_dev``), to add up paths that share one.
    """

    free: int
    block: int
    device: int


class RecordArray(Protocol):
    """One record's open array: a ``ts.TensorStore``, or :class:`~jax_mlp._src.storage.chunk_files.ChunkFiles`.

    ``read`` and ``write`` start a whole-record transfer and return what ``result()`` waits on.
    """

    @property
    def shape(self) -> tuple[int, ...]: ...

    def read(self) -> Any: ...

    def write(self, record: np.ndarray) -> Any: ...


class Backend(Protocol):
    """The operations on one process's run directory of a path; each blocks, for the engine's I/O threads.

    Records are named by key (:func:`~jax_mlp._src.storage.record.record_name`) relative to the directory.
    A backend that cannot be opened or held raises PathError itself; errors of records and of the run
    file are raised as they come, and the path turns them into errors that say what to do.

    Attributes:
      root: the path as configured, for messages.
      directory: this process's run directory on it, for messages.
    """

    root: str
    directory: str

    def open_record(self, name: str, nbytes: int | None, *, create: bool) -> RecordArray:
        """The array of record ``name``: with ``create``, of ``nbytes`` (a damaged one is recreated), else as stored."""
        ...

    def has_record(self, name: str) -> bool:
        """False when record ``name`` surely does not exist; True may leave it to the read to find out."""
        ...

    def delete_record(self, name: str) -> None:
        """Removes record ``name``, if it exists."""
        ...

    def vanished(self) -> bool:
        """Whether the run directory vanished under this writer (checked before a write, which would recreate it)."""
        ...

    def path_failed(self, error: BaseException) -> bool:
        """Whether ``error``, raised by a record's read, is the path's fault (gone, unreachable), not the record's."""
        ...

    def describe(self, error: BaseException) -> str:
        """What ``error`` says went wrong on the path and what to do about it, in one sentence naming the path."""
        ...

    def read_run_file(self) -> bytes | None:
        """The run file's content, or None if there is none."""
        ...

    def write_run_file(self, content: bytes) -> None:
        """Replaces the run file's content whole: a reader sees the old or the new one."""
        ...

    def room(self) -> Room | None:
        """The free space of the directory's file system, or None where the store has no such figure."""
        ...

    def hold(self) -> None:
        """Holds the directory for this writer until :meth:`release`; raises PathInUseError if another holds it."""
        ...

    def release(self) -> None:
        """Lets go of the directory; does nothing if not held."""
        ...

    def remove(self) -> None:
        """Deletes the directory and all it holds (and the path, where it is then empty)."""
        ...


def zarr3_spec(kvstore: dict, nbytes: int | None) -> dict:
    """The tensorstore spec of a record's zarr3 array in ``kvstore``: with ``nbytes``, the metadata to create it.

    Every chunk is stored, zeros too, so a missing chunk is damage: reading it fails, never gives zeros.
    """
    spec: dict[str, Any] = {
        "driver": "zarr3",
        "kvstore": kvstore,
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


def open_zarr3(spec: dict, context: ts.Context, *, create: bool) -> ts.TensorStore:
    """Opens a record's array; with ``create``, creates it, or recreates one that is damaged or foreign."""
    try:
        return ts.open(spec, create=create, open=True, context=context).result()
    except ValueError:
        if not create:
            raise
        # The slot holds a damaged or foreign array: it is about to be rewritten whole anyway.
        return ts.open(spec, create=True, delete_existing=True, context=context).result()


def _errno_of(error: BaseException) -> int | None:
    """The OS error number of an OSError, or the one tensorstore quotes in its message."""
    if isinstance(error, OSError) and error.errno:
        return error.errno
    match = _TENSORSTORE_ERRNO.search(str(error))
    return int(match.group(1)) if match else None


def describe_os_error(path: str, error: BaseException) -> str:
    """What went wrong on ``path`` and what to do about it, from an OSError or a tensorstore error.

    Args:
      path: the path as configured.
      error: the error an operation on it raised.

    Returns:
      One sentence naming the path, the fault and the remedy.
    """
    text, number = str(error), _errno_of(error)
    if number == errno.ENOSPC or "No space left" in text:
        return f"path {path} is full (no space left on device); free space there or give another path"
    if number == errno.EROFS:
        return f"path {path} is not writable (a read-only file system); remount it read-write or give another path"
    if number in (errno.EACCES, errno.EPERM) or "ermission" in text:
        return f"path {path} is not writable; fix its permissions or give another path"
    if number == errno.ENOENT or "NOT_FOUND" in text or "No such file" in text:
        return f"path {path} is gone (a file or directory vanished); restore it or give another path"
    what = text.splitlines()[0] if text else type(error).__name__
    return f"I/O on path {path} failed: {what}; check the path's device and mount, then retry or give another path"
