"""Where the params live for host callbacks: their mesh, each leaf's spec on it, and the host CPU device.

The in-jit route and the overlap both hand each device's blocks to the host through ``io_callback``
inside ``shard_map`` over the params' mesh. :func:`callback_layout` finds that mesh (a one-device
mesh for params on one device), refuses params it cannot map (host memory, several meshes, leaves
on one device beside sharded ones), and picks the CPU device the in-jit route's update runs on:
on CPU devices (the fake devices of tests) each device's program holds one of XLA's CPU threads
while its callback waits, so the update runs on a CPU device outside the mesh, and XLA's thread
pools need a spare thread per device besides.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_mlp._src.errors import OffloadError
from jax_mlp._src.plan.sharding import DEVICE_MEMORY, memory_kind


class CallbackLayout(NamedTuple):
    """Where host callbacks run: the params' mesh, each leaf's spec on it, and the host CPU device."""

    mesh: Mesh
    specs: tuple[P, ...]
    host: jax.Device

    def block_shapes(self, shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """Each leaf's block shape on one device of the mesh."""
        return [
            NamedSharding(self.mesh, spec).shard_shape(shape) for spec, shape in zip(self.specs, shapes, strict=True)
        ]


def xla_cpu_threads() -> int:
    """The size of each of XLA's CPU thread pools: ``NPROC`` or the usable cores, at least one per CPU device."""
    nproc = os.environ.get("NPROC", "")
    cores = int(nproc) if nproc.isdigit() and int(nproc) > 0 else len(os.sched_getaffinity(0))
    return max(cores, len(jax.local_devices(backend="cpu")))


def _mesh_of(paths: Sequence[str], leaves: Sequence[Any]) -> tuple[Mesh, tuple[P, ...]]:
    """The one mesh the leaves live on, and their specs: a one-device mesh for leaves on one device."""
    named = [(path, leaf) for path, leaf in zip(paths, leaves, strict=True) if _spans_devices(leaf)]
    if not named:
        devices = {d for leaf in leaves if isinstance(leaf, jax.Array) for d in leaf.sharding.device_set}
        if len(devices) > 1:
            raise OffloadError(
                "the params are on several devices, each leaf whole on one; update inside jit takes them on one "
                "device or sharded over one mesh with NamedSharding: place them so, or call tx.update outside jit"
            )
        device = devices.pop() if devices else jax.devices()[0]
        return Mesh(np.array([device]), ("device",)), (P(),) * len(leaves)
    if len(named) < len(leaves):
        whole = next(path for path, leaf in zip(paths, leaves, strict=True) if not _spans_devices(leaf))
        raise OffloadError(
            f"param {whole} is on one device while {named[0][0]} is sharded; update inside jit takes every leaf on "
            "one mesh: give it a NamedSharding on that mesh (P() replicates it), or call tx.update outside jit"
        )
    meshes = {leaf.sharding.mesh for _, leaf in named if isinstance(leaf.sharding, NamedSharding)}
    other = next((path for path, leaf in named if not isinstance(leaf.sharding, NamedSharding)), None)
    if other is not None or len(meshes) != 1:
        detail = f"param {other} has no NamedSharding" if other is not None else f"they use {len(meshes)} meshes"
        raise OffloadError(
            f"update inside jit maps over the params' one mesh, but {detail}; shard every leaf with a NamedSharding "
            "on one mesh, or call tx.update outside jit"
        )
    return meshes.pop(), tuple(leaf.sharding.spec for leaf in leaves)


def _spans_devices(leaf: Any) -> bool:
    """Whether ``leaf`` (an array, or a restore's ``jax.ShapeDtypeStruct``) is sharded over several devices."""
    sharding = getattr(leaf, "sharding", None)
    return isinstance(leaf, jax.Array | jax.ShapeDtypeStruct) and sharding is not None and len(sharding.device_set) > 1


def _first_cpu_device() -> jax.Device:
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError as error:  # JAX_PLATFORMS left the CPU backend out
        raise OffloadError(
            "update inside jit runs on the host CPU backend, which jax has not started: include cpu in JAX_PLATFORMS "
            f"(e.g. JAX_PLATFORMS=cuda,cpu), or call tx.update outside jit ({error})"
        ) from error


def callback_layout(paths: Sequence[str], leaves: Sequence[Any]) -> CallbackLayout:
    """The layout of ``leaves`` for host callbacks (the in-jit route, the overlap).

    Args:
      paths: each leaf's tree path, for errors.
      leaves: the params given to ``init`` (concrete arrays).

    Returns:
      The params' mesh and specs, and the CPU device the update runs on: the first CPU device for
      a mesh of accelerators, the device itself for one CPU device, else a CPU device outside the
      mesh.

    Raises:
      OffloadError: a leaf is in host memory, the leaves are not on one mesh, or they are on a mesh of
        CPU devices that XLA's CPU runtime could not serve while every device waits in its callback.
    """
    host = next(
        (
            (path, kind)
            for path, leaf in zip(paths, leaves, strict=True)
            if (kind := memory_kind(leaf)) != DEVICE_MEMORY
        ),
        None,
    )
    if host is not None:
        raise OffloadError(
            f"param {host[0]} is in {host[1]} memory; update inside jit hands each device's blocks to host callbacks "
            "and cannot stream params kept in host memory: call tx.update (or tx.apply) eagerly, outside jit, after "
            "the jitted loss and gradients"
        )
    mesh, specs = _mesh_of(paths, leaves)
    devices = list(mesh.local_devices)  # with jax.distributed, this process's callbacks
    if devices[0].platform != "cpu":
        return CallbackLayout(mesh, specs, _first_cpu_device())
    if len(devices) == 1:  # its callback runs the update on it: measured to need two threads
        host, needed = devices[0], 2
    else:
        spare = [d for d in jax.local_devices(backend="cpu") if d not in devices]
        if not spare:
            raise OffloadError(
                f"update inside jit on a mesh of all {len(devices)} CPU devices: the update runs on a CPU device "
                "outside the mesh while the mesh's devices wait in their callbacks. Start with one more CPU device "
                f"(XLA_FLAGS=--xla_force_host_platform_device_count={len(devices) + 1}) and build the mesh without "
                "it, or call tx.update outside jit"
            )
        host, needed = spare[0], 2 * len(devices) + 1  # a thread per waiting device, per transfer, and one
    threads = xla_cpu_threads()
    if threads < needed:
        raise OffloadError(
            f"update inside jit on {len(devices)} CPU device(s) needs {needed} XLA CPU threads while the devices "
            f"wait in their callbacks, but XLA has {threads}; set NPROC={needed} in the environment "
            "before jax starts, or call tx.update outside jit"
        )
    return CallbackLayout(mesh, specs, host)


def device_index(mesh: Mesh) -> jax.Array:
    """Inside ``shard_map`` over ``mesh``: this device's flat index in ``mesh.devices`` (an int32)."""
    index = sum(
        jax.lax.axis_index(name) * math.prod(mesh.devices.shape[i + 1 :]) for i, name in enumerate(mesh.axis_names)
    )
    return jnp.int32(index)
