"""Where a layer-streamed step keeps each layer's inputs between its forward and its backward.

On the device (``activations="device"``), in host memory (``"pinned_host"``: copied out as the forward
makes them, back a layer ahead of the backward), or in files (a directory: for a long sequence's
inputs, which may crowd both the device and host RAM). In files, each input is written shard by shard
through tensorstore's ``file`` key-value store as the forward makes it, on writer threads, and read
back onto its shards' devices on reader threads when the backward asks for it (a layer ahead): only
the inputs in flight are in memory.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import tensorstore as ts

from jax_mlp._src.errors import OffloadError
from jax_mlp._src.plan.sharding import DEVICE_MEMORY, MEMORY_KINDS, in_memory


class Spilled(NamedTuple):
    """One input in the files: its shape, dtype and sharding, each shard's device and shape, and its write."""

    key: str
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: jax.sharding.Sharding
    shards: tuple[tuple[jax.Device, tuple[int, ...]], ...]
    written: concurrent.futures.Future


class InputFiles:
    """The files of one stream's layer inputs, in ``directory/inputs.proc{process index}``, removed by :meth:`close`.

    Args:
      directory: where the files go; created if missing.
      threads: writer threads, and as many reader threads.

    Raises:
      OffloadError: the directory cannot be created or written, naming it.
    """

    def __init__(self, directory: str | os.PathLike, threads: int):
        self.directory = os.path.join(os.fspath(directory), f"inputs.proc{jax.process_index():04d}")
        try:
            os.makedirs(self.directory, exist_ok=True)
            probe = os.path.join(self.directory, ".probe")
            with open(probe, "wb") as f:
                f.write(b"0")
            os.remove(probe)
        except OSError as error:
            raise OffloadError(
                f"activations directory {self.directory} cannot be written ({error}); give a writable directory "
                "for the layers' inputs, or keep them in memory (activations='device' or 'pinned_host')"
            ) from error
        self._store = ts.KvStore.open({"driver": "file", "path": self.directory + "/"}).result()
        self._writers = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="jax_mlp-inputs-out")
        self._readers = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="jax_mlp-inputs-in")

    def put(self, key: str, x: jax.Array) -> Spilled:
        """Starts writing ``x`` under ``key`` (replacing what was there); the device may drop it once written."""
        shards = tuple((shard.device, tuple(shard.data.shape)) for shard in x.addressable_shards)
        written = self._writers.submit(self._write, key, x)
        return Spilled(key, tuple(x.shape), np.dtype(x.dtype), x.sharding, shards, written)

    def _write(self, key: str, x: jax.Array) -> None:
        for n, shard in enumerate(x.addressable_shards):
            data = np.ascontiguousarray(np.asarray(shard.data)).tobytes()
            try:
                self._store.write(f"{key}.{n}", data).result()
            except Exception as error:  # tensorstore raises ValueError (a full disk among its causes)
                raise OffloadError(
                    f"writing a layer's input ({len(data)} bytes) to {os.path.join(self.directory, f'{key}.{n}')} "
                    f"failed ({error}); free space there or give another directory for activations; the step is "
                    "not committed, so the tiers keep the last one"
                ) from error

    def get(self, spilled: Spilled) -> concurrent.futures.Future:
        """Reads ``spilled`` back onto its devices on a reader thread; the future gives the array."""

        def read() -> jax.Array:
            spilled.written.result()
            arrays = []
            for n, (device, shape) in enumerate(spilled.shards):
                data = self._store.read(f"{spilled.key}.{n}").result().value
                arrays.append(jax.device_put(np.frombuffer(data, spilled.dtype).reshape(shape), device))
            return jax.make_array_from_single_device_arrays(spilled.shape, spilled.sharding, arrays)

        return self._readers.submit(read)

    def close(self) -> None:
        """Waits for the threads and removes the files."""
        self._writers.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        shutil.rmtree(self.directory, ignore_errors=True)


def check_where(where: Any) -> None:
    """Refuses a place for the inputs that is neither a memory kind nor a directory (an ``os.PathLike``).

    Raises:
      OffloadError: naming what was given and what is accepted.
    """
    if not isinstance(where, os.PathLike) and where not in MEMORY_KINDS:
        raise OffloadError(
            f"activations must be one of {', '.join(map(repr, MEMORY_KINDS))} or a directory as a pathlib.Path "
            f"(where each layer's input is kept between the forward and the backward), got {where!r}"
        )


class KeptInputs:
    """The layers' inputs kept for the backward: in a memory kind of their devices, or in :class:`InputFiles`.

    Args:
      where: ``"device"``, ``"pinned_host"``, or a directory (an ``os.PathLike``) for the files (see
        :func:`check_where`).
      threads: the files' writer and reader threads.

    Raises:
      OffloadError: the directory cannot be written.
    """

    def __init__(self, where: str | os.PathLike, threads: int):
        self._kind = None if isinstance(where, os.PathLike) else where
        self._files = None if self._kind else InputFiles(where, threads)

    def keep(self, index: int, xs: Sequence[jax.Array]) -> list[Any]:
        """Layer ``index``'s inputs (one per micro-batch) kept: in their memory kind, or being written."""
        if self._files is None:
            return [in_memory(x, self._kind) for x in xs]
        return [self._files.put(f"{index}.{m}", x) for m, x in enumerate(xs)]

    def bring(self, kept: Sequence[Any]) -> list[Any]:
        """Kept inputs coming back to the device: copies dispatched, or reads started (futures); see :func:`ready`."""
        if self._files is None:
            return [in_memory(x, DEVICE_MEMORY) for x in kept]
        return [self._files.get(spilled) for spilled in kept]

    def close(self) -> None:
        """Removes the files, if any."""
        if self._files is not None:
            self._files.close()


def wait(kept: Sequence[Any]) -> None:
    """Waits until a layer's inputs are kept: their copies made, or their files written."""
    for x in kept:
        if isinstance(x, Spilled):
            x.written.result()
        else:
            x.block_until_ready()


def ready(xs: Sequence[Any]) -> list[jax.Array]:
    """Inputs :meth:`KeptInputs.bring` brought back, as arrays: a read's result, or the array."""
    return [x.result() if isinstance(x, concurrent.futures.Future) else x for x in xs]
