"""Chunk-file I/O: one record's zarr3 chunk files moved with ``os.pwrite``/``os.preadv``, O_DIRECT where allowed."""

from __future__ import annotations

import concurrent.futures
import errno
import os
import shutil
from typing import Any

import numpy as np

from jax_mlp._src.storage.buffers import ALIGNMENT, aligned_buffer

CHUNK_REQUESTS = 8  # chunk files in flight per local path (measured: 4 to 8 reach the disk's bandwidth)


class _Requests:
    """Chunk transfers of one record in flight on a pool; ``result`` waits for all, then raises the first error."""

    def __init__(self, futures: list[concurrent.futures.Future], value: Any = None):
        self._futures, self._value = futures, value

    def result(self) -> Any:
        concurrent.futures.wait(self._futures)
        for future in self._futures:
            future.result()
        return self._value


def allows_direct_io(name: str) -> bool:
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
