"""Storage paths: a backend's records moved through the path's traffic control, with errors that say what to do.

Each process keeps its records in ``proc{process_index}`` of a path, with the run's identity in
``run.json`` beside them. A writer holds that directory (:meth:`PathStore.hold`, see
:mod:`~jax_mlp._src.storage.ownership`) from ``init`` to ``close``. Every method blocks and is meant for
the engine's I/O threads; every error names the path and says what to do.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
from collections.abc import Sequence

import jax
import numpy as np

from jax_mlp._src.config import OffloadConfig, Path
from jax_mlp._src.errors import PathError, RecordError
from jax_mlp._src.storage.backend import RUN_FILE, Backend, RecordArray
from jax_mlp._src.storage.kvstore import KvStoreBackend
from jax_mlp._src.storage.local import LocalBackend
from jax_mlp._src.storage.record import RECORD_REMEDY, read_header, record_name, verify
from jax_mlp._src.storage.traffic import Traffic


class PathStore:
    """One storage path: a :class:`~jax_mlp._src.storage.backend.Backend` composed with its :class:`Traffic`.

    The backend stores the bytes; this class owns what every backend shares: each record's open
    array, one metered transfer per record read or written, and errors that name the path or the
    record (:class:`PathError`, :class:`RecordError`) and say what to do.

    Args:
      backend: the process's run directory on the path.
      traffic: the path's in-flight limit, node lock, caps and meter.
    """

    def __init__(self, backend: Backend, traffic: Traffic):
        self.backend = backend
        self.traffic = traffic
        self._arrays: dict[tuple[int, int], RecordArray] = {}
        self._lock = threading.Lock()

    @property
    def root(self) -> str:
        """The path as configured, for messages and stats."""
        return self.backend.root

    @property
    def directory(self) -> str:
        """This process's run directory on the path."""
        return self.backend.directory

    def _name(self, subgroup: int, slot: int) -> str:
        return os.path.join(self.directory, record_name(subgroup, slot))

    def _array(self, subgroup: int, slot: int, nbytes: int | None, *, create: bool) -> RecordArray:
        """The record's array, opened once and kept; reopened (recreated) when a write brings another size."""
        key = (subgroup, slot)
        with self._lock:
            array = self._arrays.get(key)
        if array is not None and (nbytes is None or array.shape[0] == nbytes):
            return array
        array = self.backend.open_record(record_name(subgroup, slot), nbytes, create=create)
        with self._lock:
            self._arrays[key] = array
        return array

    def write(self, subgroup: int, slot: int, record: np.ndarray) -> None:
        """Writes a whole sealed record to its slot; raises PathError naming this path."""
        try:
            if self.backend.vanished():  # the backend would silently recreate the directories
                raise FileNotFoundError(errno.ENOENT, "the directory vanished", self.directory)
            array = self._array(subgroup, slot, record.nbytes, create=True)
            with self.traffic.metered("write", record.nbytes):
                array.write(record).result()
        except Exception as error:  # tensorstore raises ValueError and OSError-like errors
            raise PathError(f"writing record {self._name(subgroup, slot)}: {self.backend.describe(error)}") from error

    def read(self, subgroup: int, slot: int) -> np.ndarray:
        """Reads a whole record back into a new buffer; raises RecordError if it is missing."""
        try:
            array = self._array(subgroup, slot, None, create=False)
            with self.traffic.metered("read", array.shape[0]):
                return array.read().result()
        except Exception as error:
            name = self._name(subgroup, slot)
            if self.backend.path_failed(error):
                raise PathError(f"reading record {name}: {self.backend.describe(error)}") from error
            raise RecordError(
                f"record {name} is missing or unreadable ({str(error).splitlines()[0]}); {RECORD_REMEDY}"
            ) from error

    def verified_step(self, subgroup: int, slot: int, layout_hash: bytes) -> int | None:
        """The step of the record in ``slot`` if it exists and passes every check, else None."""
        if not self.backend.has_record(record_name(subgroup, slot)):
            return None
        name = self._name(subgroup, slot)
        try:
            record = self.read(subgroup, slot)
            step = read_header(record, name).step
            verify(record, name=name, step=step, layout_hash=layout_hash)
        except RecordError:
            return None
        return step

    def delete(self, subgroup: int) -> None:
        """Removes both slots of ``subgroup`` from this path (after it moved to another one)."""
        for slot in (0, 1):
            with self._lock:
                self._arrays.pop((subgroup, slot), None)
            try:
                self.backend.delete_record(record_name(subgroup, slot))
            except Exception as error:
                raise PathError(
                    f"deleting record {self._name(subgroup, slot)}: {self.backend.describe(error)}"
                ) from error

    def read_run_file(self) -> dict | None:
        """The run's identity as written by :meth:`write_run_file`, or None where there is none."""
        content = self.backend.read_run_file()
        return None if content is None else json.loads(content)

    def write_run_file(self, content: dict) -> None:
        """Writes the run's identity, whole or not at all; raises PathError naming this path."""
        encoded = json.dumps(content).encode()
        try:
            self.backend.write_run_file(encoded)
        except Exception as error:
            name = os.path.join(self.directory, RUN_FILE)
            raise PathError(f"writing {name}: {self.backend.describe(error)}") from error

    def remove(self) -> None:
        """Deletes this process's directory on the path, and the path itself if then empty."""
        self.backend.remove()

    def hold(self) -> None:
        """Holds this process's run directory for this writer until :meth:`release`.

        Raises:
          PathInUseError: another writer holds it (the message names its pid and host).
          PathError: the lock file cannot be created.
        """
        self.backend.hold()

    def release(self) -> None:
        """Lets go of the run directory (after ``close``, or a failed ``init``); does nothing if not held."""
        self.backend.release()


def _node_lock_file(path: Path, node_lock: str | None) -> str | None:
    """The path's lock file in the node-local ``node_lock`` directory, or None for no lock."""
    if node_lock is None:
        return None
    os.makedirs(node_lock, exist_ok=True)
    digest = hashlib.sha256(path.identity.encode()).hexdigest()[:24]
    return os.path.join(node_lock, f"{digest}.lock")


def open_path(
    path: Path,
    process_index: int = 0,
    *,
    max_inflight: int,
    node_lock: str | None,
    store_timeout: float,
) -> PathStore:
    """The store for one configured path, a local directory or a tensorstore kvstore spec.

    Args:
      path: the path, with its caps.
      process_index: this process's index (its records go to ``proc{index}``).
      max_inflight: transfers in flight at once on the path.
      node_lock: a node-local directory for cross-process path locks, or None for no lock.
      store_timeout: on a kvstore, seconds of retries before a failing request fails.

    Returns:
      The store, with its traffic control in place.

    Raises:
      PathError: the path cannot be opened or written.
    """
    traffic = Traffic(max_inflight, _node_lock_file(path, node_lock), path.max_read, path.max_write)
    if isinstance(path.location, dict):
        return PathStore(KvStoreBackend(path.location, process_index, store_timeout), traffic)
    return PathStore(LocalBackend(path.location, process_index), traffic)


def open_configured(config: OffloadConfig) -> list[PathStore]:
    """The paths of ``config``, opened and held for this process (see :func:`open_paths`)."""
    return open_paths(
        config.paths,
        jax.process_index(),
        max_inflight=config.max_inflight,
        node_lock=config.node_lock,
        store_timeout=config.store_timeout,
    )


def open_paths(
    paths: Sequence[Path],
    process_index: int = 0,
    *,
    max_inflight: int,
    node_lock: str | None,
    store_timeout: float,
) -> list[PathStore]:
    """Opens every configured path and holds its run directory for this writer.

    Args:
      paths: the configured paths.
      process_index: this process's index.
      max_inflight: transfers in flight at once on each path.
      node_lock: a node-local directory for cross-process path locks, or None for no lock.
      store_timeout: on a kvstore, seconds of retries before a failing request fails.

    Returns:
      The stores, each held until its :meth:`~PathStore.release`.

    Raises:
      PathInUseError: a path's run directory is held by another writer; the paths held so far are released.
      PathError: a path cannot be opened; the paths held so far are released.
    """
    opened: list[PathStore] = []
    try:
        for path in paths:
            opened.append(
                open_path(
                    path, process_index, max_inflight=max_inflight, node_lock=node_lock, store_timeout=store_timeout
                )
            )
            opened[-1].hold()
    except BaseException:
        release_paths(opened)
        raise
    return opened


def release_paths(paths: Sequence[PathStore]) -> None:
    """Lets go of every path's run directory (see :func:`open_paths`)."""
    for path in paths:
        path.release()
