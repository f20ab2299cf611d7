"""Sharding: where each leaf's blocks live on the devices, and the user's sharding for the updates.

A leaf on one device is one block. A sharded leaf is the shards this process owns: a replica is
stored and updated once, by its owner, and its update is copied to the other devices holding it.

Each leaf also has a memory kind: the device's own memory, or the host memory ``pinned_host``
(params larger than the devices, streamed in by the user's jitted step). Programs run on device
memory only; :func:`in_memory` moves a block between the two.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax

from jax_mlp._src.plan import partition
from jax_mlp._src.plan.partition import Plan, Shard

BlockKey = tuple[int, int | None]
"""An update block's key: (leaf index, owner device id), the owner None for a leaf on one device."""

DEVICE_MEMORY = "device"
"""The memory kind of a device's own memory: where every subgroup program's inputs and outputs are."""
HOST_MEMORY = "pinned_host"
"""The host memory kind params and grads may live in besides the device's: blocks visit the device for their programs."""
MEMORY_KINDS = (DEVICE_MEMORY, HOST_MEMORY)
"""The memory kinds params and grads may be in."""


def memory_kind(x: Any) -> str:
    """The memory kind of an array, a tracer or a ``jax.ShapeDtypeStruct``: device memory where it names none."""
    if isinstance(x, jax.core.Tracer):
        return HOST_MEMORY if jax.typeof(x).memory_space == jax.memory.Space.Host else DEVICE_MEMORY
    return getattr(getattr(x, "sharding", None), "memory_kind", None) or DEVICE_MEMORY


def in_memory(x: jax.Array, kind: str) -> jax.Array:
    """``x`` in memory ``kind`` of its devices: itself if it is there, else a copy (dispatched asynchronously).

    The copy keeps the placement and changes the memory only, as the JAX guide "Memories and host
    offloading" does; a ``jax.device_put`` to a bare ``Device`` would fail on the block's own device.
    """
    return x if memory_kind(x) == kind else jax.device_put(x, x.sharding.with_memory_kind(kind))


class LeafSharding(NamedTuple):
    """Each leaf's sharding, owned shards and memory kind, as at ``init`` (sharding and shards None for a leaf on one device).

    Attributes:
      shardings: per leaf, its ``jax.sharding.Sharding`` if it spans devices, else None.
      shards: per leaf, the shards this process owns (see :func:`partition.owned_shards`), or None.
      kinds: per leaf, its memory kind (:data:`DEVICE_MEMORY` or :data:`HOST_MEMORY`): grads, params,
        updates and new params are all in it.
    """

    shardings: tuple[jax.sharding.Sharding | None, ...]
    shards: tuple[tuple[Shard, ...] | None, ...]
    kinds: tuple[str, ...]

    @classmethod
    def of(cls, leaves: Sequence[Any]) -> LeafSharding:
        """The placement of the params' leaves (arrays, or anything else for a leaf on the default device)."""
        shards = tuple(partition.owned_shards(x) for x in leaves)
        shardings = tuple(None if s is None else x.sharding for x, s in zip(leaves, shards, strict=True))
        return cls(shardings, shards, tuple(memory_kind(x) for x in leaves))

    def owners(self, plan: Plan) -> list[dict[jax.Device, int] | None]:
        """Per leaf, the owner of the block each of its devices holds (:func:`partition.block_owners`), or None."""
        return [
            None if sharding is None else partition.block_owners(spec.shape, sharding, shards)
            for spec, sharding, shards in zip(plan.leaves, self.shardings, self.shards, strict=True)
        ]

    def home(self, leaves: Sequence[Any]) -> jax.Device | None:
        """Where subgroups of leaves on one device go: that device if ``leaves`` are committed, else None.

        Uncommitted inputs give uncommitted updates, so the user's params keep their commitment and
        their jitted step does not recompile. Subgroups of sharded leaves run where their shards are.
        """
        first = next((x for x, sharding in zip(leaves, self.shardings, strict=True) if sharding is None), None)
        return next(iter(first.devices())) if first is not None and first.committed else None

    def devices(self, plan: Plan, leaves: Sequence[Any]) -> list[jax.Device | None]:
        """Per subgroup, where its program runs: its shards' device, or the :meth:`home` of ``leaves``."""
        home = self.home(leaves)
        by_id = _devices_by_id()
        return [home if sg.pieces[0].device is None else by_id[sg.pieces[0].device] for sg in plan.subgroups]

    def block_map(self, leaves: Sequence[jax.Array], indices: Sequence[int] | None = None) -> dict[BlockKey, jax.Array]:
        """Each leaf's data on each device that holds a block of it, by (leaf, device id; None: one device).

        A leaf that arrives with another sharding than at ``init`` is first resharded to that one,
        shard to shard, so each block is found on the device that owns its state. ``indices`` are the
        leaves' indices when they are some of the leaves (a layer's), in order.
        """
        blocks: dict[BlockKey, jax.Array] = {}
        indices = range(len(self.shardings)) if indices is None else indices
        for index, leaf in zip(indices, leaves, strict=True):
            sharding = self.shardings[index]
            if sharding is None:
                blocks[index, None] = leaf
                continue
            if not leaf.sharding.is_equivalent_to(sharding, leaf.ndim):
                leaf = jax.device_put(leaf, sharding)
            blocks.update(((index, shard.device.id), shard.data) for shard in leaf.addressable_shards)
        return blocks

    def assemble(
        self, plan: Plan, results: dict[BlockKey, jax.Array], indices: Sequence[int] | None = None
    ) -> list[jax.Array]:
        """Each leaf's update: its one block, or its owned blocks assembled with the leaf's sharding.

        Replicas get a device-to-device copy of their owner's block, in the block's memory kind; no
        device ever holds more than its own block. ``indices`` picks some of the leaves (a layer's).
        """
        leaves = []
        indices = range(len(plan.leaves)) if indices is None else indices
        for index in indices:
            spec, sharding = plan.leaves[index], self.shardings[index]
            if sharding is None:
                leaves.append(results[index, None])
                continue
            arrays = []
            owners = partition.block_owners(spec.shape, sharding, self.shards[index])
            for device, owner in owners.items():
                block = results[index, owner]
                copy = jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind(block))
                arrays.append(block if block.devices() == {device} else jax.device_put(block, copy))
            leaves.append(jax.make_array_from_single_device_arrays(spec.shape, sharding, arrays))
        return leaves

    def blocks_of(self, leaf: int, shape: tuple[int, ...]) -> list[tuple[tuple[tuple[int, int], ...], jax.Device]]:
        """Every block of a sharded leaf, over all processes, with the first device holding it.

        The order is the sharding's device order, the same in every process; that first device
        holds the block's replica 0.
        """
        return _first_holders(self.shardings[leaf], shape)

    def written_here(self, leaf: int, shape: tuple[int, ...], box: tuple[tuple[int, int], ...] | None) -> bool:
        """Whether this process writes ``box`` (inside one block of leaf ``leaf``, or None: all of it) to a checkpoint.

        Each block is written once over all processes: by the process holding its replica 0; a leaf
        on one device (each process has its own) by process 0, as orbax's primary host.
        """
        if self.shardings[leaf] is None:
            return jax.process_index() == 0
        corner = tuple(start for start, _ in box)
        device = next(
            device
            for block, device in self.blocks_of(leaf, shape)
            if all(lo <= at < hi for at, (lo, hi) in zip(corner, block, strict=True))
        )
        return device.process_index == jax.process_index()

    def block_keys(self, plan: Plan, devices: Sequence[jax.Device]) -> dict[int, list[BlockKey]]:
        """Per device, for each leaf, the key of the update block that device receives."""
        owners = self.owners(plan)
        return {
            device.id: [(index, None if of is None else of[device]) for index, of in enumerate(owners)]
            for device in devices
        }


@functools.lru_cache(maxsize=1024)
def _first_holders(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> list:
    """Each block of a leaf of ``shape`` with ``sharding``, and the first device holding it (a save asks per region)."""
    first: dict[tuple[tuple[int, int], ...], jax.Device] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        first.setdefault(partition.shard_box(index, shape), device)
    return list(first.items())


@functools.cache
def _devices_by_id() -> dict[int, jax.Device]:
    return {device.id: device for device in jax.devices()}
