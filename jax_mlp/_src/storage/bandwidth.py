"""A path's bandwidth, measured by the probe: records written and read through the same tier code training uses.

Records go to a scratch directory on the path (``.jax_mlp_probe``) through a :class:`PathStore`
with the path's own caps and in-flight limit, several at once. Between writing and reading, a
local directory's files are synced and dropped from the page cache (``posix_fadvise``), so the
reads come from the device. The scratch directory is removed afterwards.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import time
from typing import Any, NamedTuple

import numpy as np

from jax_mlp._src.config import OffloadConfig, Path
from jax_mlp._src.storage.paths import PathStore, open_path
from jax_mlp._src.storage.record import new_record, seal

PROBE_DIRECTORY = ".jax_mlp_probe"


class ProbeResult(NamedTuple):
    """One path's measured bandwidths.

    Attributes:
      path: the path's name.
      read_bandwidth: bytes/s read.
      write_bandwidth: bytes/s written.
      nbytes: bytes moved each way.
      serial: how far reading and writing at once serialise: 0 when the two take no longer together than
        the slower alone (a full-duplex device: a kernel throttle per direction, a network link), 1 when
        they take their sum (one pipe shared by both).
    """

    path: str
    read_bandwidth: float
    write_bandwidth: float
    nbytes: int
    serial: float = 1.0


def _open_scratch(path: Path, inflight: int) -> PathStore:
    """The path's scratch directory, opened with its caps, ``inflight`` in flight, no node lock and the default
    ``store_timeout``."""
    location = path.location
    if isinstance(location, dict):
        prefix = location.get("path", "").rstrip("/")
        scratch = {**location, "path": f"{prefix}/{PROBE_DIRECTORY}/" if prefix else f"{PROBE_DIRECTORY}/"}
    else:
        scratch = os.path.join(location, PROBE_DIRECTORY)
    return open_path(
        Path(scratch, max_read=path.max_read, max_write=path.max_write),
        max_inflight=inflight,
        node_lock=None,
        store_timeout=OffloadConfig.defaults()["store_timeout"],
    )


def drop_page_cache(directory: str) -> None:
    """Syncs every file under ``directory`` and drops it from the page cache, so reads come from the device."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _timed(calls: list, inflight: int) -> float:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(inflight) as pool:
        list(pool.map(lambda call: call(), calls))
    return time.perf_counter() - start


def _records(record_bytes: int) -> np.ndarray:
    """A sealed record of ``record_bytes`` of random payload, like training's."""
    record = new_record(record_bytes)
    record[64:] = np.random.default_rng(0).integers(0, 256, record_bytes, dtype=np.uint8)
    seal(record, 0, bytes(16))
    return record


def probe(
    path: Path, *, total_bytes: int = 256 * 1024**2, record_bytes: int = 16 * 1024**2, inflight: int = 4
) -> ProbeResult:
    """Measures a path's write and read bandwidth with records like training's, and whether it does both at once.

    It writes the records, reads them back, then reads them while writing as many again: the third
    phase against the first two says how far the directions serialise (``ProbeResult.serial``).

    Args:
      path: the path to measure (its caps apply, as in training).
      total_bytes: bytes written and then read back.
      record_bytes: the size of each record.
      inflight: records in flight at once.

    Returns:
      The measured bandwidths in bytes/s.
    """
    store = _open_scratch(path, inflight)
    count = max(1, total_bytes // record_bytes)
    record = _records(record_bytes)
    try:
        written = _timed([lambda k=k: store.write(k, 0, record) for k in range(count)], inflight)
        _drop(path, store)
        read = _timed([lambda k=k: store.read(k, 0) for k in range(count)], inflight)
        together = _both_at_once(path, store, count, count, record, inflight)
    finally:
        store.remove()
    nbytes = count * record.nbytes
    serial = (together - max(read, written)) / min(read, written)
    return ProbeResult(path.name, nbytes / read, nbytes / written, nbytes, min(1.0, max(0.0, serial)))


def _drop(path: Path, store: Any) -> None:
    """Drops a local path's records from the page cache, so the next reads come from the device."""
    if not isinstance(path.location, dict):
        drop_page_cache(store.directory)


def _both_at_once(path: Path, store: Any, reads: int, writes: int, record: np.ndarray, inflight: int) -> float:
    """Seconds to read records ``0..reads`` of slot 0 while writing ``writes`` records to slot 1."""
    _drop(path, store)
    read = [lambda k=k: store.read(k, 0) for k in range(reads)]
    write = [lambda k=k: store.write(k, 1, record) for k in range(writes)]
    both = [call for pair in itertools.zip_longest(read, write) for call in pair if call is not None]
    return _timed(both, 2 * inflight)  # interleaved: each direction keeps about ``inflight`` in flight
