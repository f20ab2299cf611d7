"""A layer-streamed model's units read from their records onto the devices, on reader threads, ahead of their use.

A unit (a layer, or the outer params) is the pieces of its subgroups' records: its params records, or
the grads records of a deferred update. Each leaf's pieces are put together on the device of the
subgroups that hold them, and a sharded leaf's blocks assembled with its sharding, so the per-layer
programs get ordinary (sharded) arrays. The forward reads a few units ahead, the backward one.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jax_mlp._src.plan import partition
from jax_mlp._src.plan.layers import LayerPlan, Unit
from jax_mlp._src.plan.partition import Piece
from jax_mlp._src.stream.state_stream import StateStream


class UnitReads:
    """Reads the units of ``plan`` from ``stream``'s records on ``threads`` reader threads.

    Args:
      plan: the layer-streamed plan.
      stream: the state stream holding its records.
      devices: per subgroup, the device its pieces go to.
      threads: reader threads; the forward reads half as many units ahead.
    """

    def __init__(self, plan: LayerPlan, stream: StateStream, devices: Sequence[jax.Device], threads: int):
        self._plan, self._stream, self._devices = plan, stream, list(devices)
        self._depth = max(1, threads // 2)
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="jax_mlp-params")

    def leaves(self, unit: Unit, step: int, fetch: Callable[[int, int], list]) -> list[jax.Array]:
        """``unit``'s leaves on the devices, ``fetch(k, step)`` giving subgroup k's pieces (params or grads)."""
        plan = self._plan
        specs = plan.plan.leaves
        parts: dict[tuple, list[tuple[Piece, np.ndarray]]] = {}
        device_of: dict[tuple, jax.Device] = {}
        for k in unit.subgroups:
            subgroup = plan.plan.subgroups[k]
            for piece, value in zip(subgroup.pieces, fetch(k, step), strict=True):
                parts.setdefault((piece.leaf, piece.device), []).append((piece, value))
                device_of[piece.leaf, piece.device] = self._devices[k]
        blocks = {}
        for key, chunks in parts.items():
            chunks.sort(key=lambda pv: 0 if pv[0].rows is None else pv[0].rows[0])
            host = chunks[0][1] if len(chunks) == 1 else np.concatenate([v for _, v in chunks])
            shape = partition.piece_shape(specs[key[0]], chunks[0][0]._replace(rows=None))
            blocks[key] = jax.device_put(host.reshape(shape), device_of[key])
        return plan.sharding.assemble(plan.plan, blocks, unit.leaves)

    def params(self, unit: Unit, step: int, written: Callable[[int], None] | None = None) -> concurrent.futures.Future:
        """Reads ``unit``'s params at ``step``, each subgroup's once ``written(k)`` returns (if given: an update
        still writing them); the future gives its leaves on the devices."""
        fetch = self._stream.fetch_params
        if written is not None:
            fetch = functools.partial(_once_written, written, fetch)
        return self._pool.submit(self.leaves, unit, step, fetch)

    def params_and_grads(self, unit: Unit, step: int) -> concurrent.futures.Future:
        """Reads ``unit``'s params at ``step`` and the grads stored for its update to ``step + 1``."""
        stream = self._stream
        return self._pool.submit(
            lambda: (self.leaves(unit, step, stream.fetch_params), self.leaves(unit, step + 1, stream.fetch_grads))
        )

    def ahead(
        self, units: Sequence[Unit], read: Callable[[Unit], concurrent.futures.Future], depth: int | None = None
    ) -> Iterator[Any]:
        """What ``read`` gives each unit, in order, read ``depth`` units ahead of the one computing (by default
        half the reader threads); the first reads start now."""
        depth = self._depth if depth is None else depth
        return self._in_order(units, read, depth, [read(unit) for unit in units[:depth]])

    @staticmethod
    def _in_order(
        units: Sequence[Unit], read: Callable[[Unit], concurrent.futures.Future], depth: int, futures: list
    ) -> Iterator[Any]:
        for index in range(len(units)):
            if index + depth < len(units):
                futures.append(read(units[index + depth]))
            yield futures[index].result()
            futures[index] = None

    def close(self) -> None:
        """Waits for the reads in flight and stops the threads."""
        self._pool.shutdown(wait=True)


def _once_written(written: Callable[[int], None], fetch: Callable[[int, int], list], index: int, step: int) -> list:
    written(index)
    return fetch(index, step)
