"""Layer inputs kept in files between a layer-streamed forward and its backward (``activations=<a directory>``).

A long sequence's inputs, one per layer and micro-batch, may crowd both the device and host RAM. Each
is written, shard by shard, to a file of the directory through tensorstore's ``file`` key-value store
as the forward makes it, on writer threads, and read back onto its shards' devices on reader threads
when the backward asks for it (a layer ahead). Only the inputs in flight are in memory.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
from typing import NamedTuple

import jax
import numpy as np
import tensorstore as ts

from jax_mlp._src.errors import OffloadError


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
