"""The in-jit route: ``update`` traced inside ``jax.jit`` becomes one host callback per device.

Inside jit the state cannot stream through the devices. Instead each device hands its blocks of the
grads (and params) to the host through ``io_callback``, inside ``shard_map`` over the params' mesh
with their ``PartitionSpec``s. The callbacks meet at a :class:`Rendezvous`: the last to arrive runs
the update of every owned block on the host CPU backend, as ZeRO-Offload's CPU Adam does, and each
callback returns its device's block of the updates. A replica returns its owner's block, so no state
is stored or updated twice, and no device ever holds more than its own block.

On CPU devices (the fake devices of tests) each device's program holds one of XLA's CPU threads
while its callback waits, so the update runs on a CPU device outside the mesh, and XLA's thread
pools need a spare thread per device besides (:func:`jit_layout` checks both).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_mlp._src.errors import OffloadError
from jax_mlp._src.plan.partition import Plan
from jax_mlp._src.plan.programs import Uniform, update_dtype
from jax_mlp._src.plan.sharding import DEVICE_MEMORY, BlockKey, LeafSharding, memory_kind
from jax_mlp._src.stream.blocks import Blocks, Staging
from jax_mlp._src.stream.state_stream import IN_CALLBACK, StateStream

logger = logging.getLogger(__name__)


class JitLayout(NamedTuple):
    """Where the in-jit route runs: the params' mesh, each leaf's spec on it, and the host device."""

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


def jit_layout(paths: Sequence[str], leaves: Sequence[Any]) -> JitLayout:
    """The layout of ``leaves`` for the in-jit route.

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
        return JitLayout(mesh, specs, _first_cpu_device())
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
    return JitLayout(mesh, specs, host)


def host_update(
    layout: JitLayout,
    on_device: Callable[..., list[np.ndarray]],
    grads: Sequence[jax.Array],
    params: Sequence[jax.Array] | None,
    step: jax.Array,
    uniform: Uniform,
    out_blocks: Sequence[jax.ShapeDtypeStruct],
) -> list[jax.Array]:
    """Traces the update as one ``on_device(step, device_index, uniform, *grad_blocks, *param_blocks)`` per device.

    Args:
      layout: from :func:`jit_layout`.
      on_device: runs on the host, once per device of the mesh, with that device's flat index in
        the mesh and its blocks; returns the device's block of each leaf's update.
      grads: the gradient leaves (tracers).
      params: the param leaves, or None.
      step: the traced step of the ``OffloadState``.
      uniform: what every subgroup is given alike (tracers), replicated to every device.
      out_blocks: per leaf, the shape and dtype of one device's block of its update.

    Returns:
      The update leaves, sharded as the params.
    """
    mesh, specs = layout.mesh, list(layout.specs)
    params = list(params or [])

    def per_device(step, uniform, grads, params):
        return io_callback(on_device, list(out_blocks), step, device_index(mesh), uniform, *grads, *params)

    mapped = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(), P(), specs, specs if params else []),
        out_specs=specs,
        check_vma=False,
    )
    return mapped(step, uniform, list(grads), params)


def device_index(mesh: Mesh) -> jax.Array:
    """Inside ``shard_map`` over ``mesh``: this device's flat index in ``mesh.devices`` (an int32)."""
    index = sum(
        jax.lax.axis_index(name) * math.prod(mesh.devices.shape[i + 1 :]) for i, name in enumerate(mesh.axis_names)
    )
    return jnp.int32(index)


class Rendezvous:
    """Where the callbacks of one step meet: the last to arrive runs the step for all of them.

    Args:
      parties: the callbacks per step (the mesh's devices).
      timeout: seconds a callback waits for the others and for the step before it raises
        (``peer_timeout``).
    """

    def __init__(self, parties: int, timeout: float):
        self._parties = parties
        self._timeout = timeout
        self._condition = threading.Condition()
        self._arrived: dict[int, dict[int, Any]] = {}
        self._outcomes: dict[int, tuple[Any, BaseException | None, set[int]]] = {}

    def meet(self, key: int, party: int, payload: Any, work: Callable[[dict[int, Any]], Any]) -> Any:
        """Leaves ``payload``; the last party calls ``work`` with every payload. Returns ``work``'s result.

        Raises:
          OffloadError: the other parties or the step did not come within the timeout.
          BaseException: whatever ``work`` raised, in every party.
        """
        with self._condition:
            arrived = self._arrived.setdefault(key, {})
            arrived[party] = payload
            last = len(arrived) == self._parties
            if last:
                del self._arrived[key]
        if last:
            try:
                outcome = (work(arrived), None)
            except BaseException as error:
                outcome = (None, error)
            with self._condition:
                self._outcomes[key] = (*outcome, set(arrived))
                self._condition.notify_all()
        with self._condition:
            if not self._condition.wait_for(lambda: key in self._outcomes, self._timeout):
                waiting_for = self._arrived.pop(key, None)  # None: all arrived, the update is running
                what = "the update did not finish"
                if waiting_for is not None:
                    what = f"{self._parties - len(waiting_for)} of {self._parties} devices' callbacks did not arrive"
                raise OffloadError(
                    f"in-jit update at step {key}: {what} within peer_timeout={self._timeout} s; the step is "
                    "intact on storage"
                )
            result, error, waiting = self._outcomes[key]
            waiting.discard(party)
            if not waiting:
                del self._outcomes[key]
        if error is not None:
            raise error
        return result


class JitRoute:
    """The in-jit route of one offloader: the layout it runs on, or the reason it cannot.

    Made at ``init``; :meth:`trace` is what ``update`` becomes when traced. A layout that would not
    run is only refused when the route is taken, since most users never trace ``update``.

    Args:
      plan: the subgroups.
      sharding: the leaves' shardings and owned shards.
      leaves: the params given to ``init``.
      stream: runs each step's update, on the host CPU device.
      peer_timeout: seconds each device's callback waits for the others and for the update.
    """

    def __init__(
        self, plan: Plan, sharding: LeafSharding, leaves: Sequence[Any], stream: StateStream, peer_timeout: float
    ):
        self._plan = plan
        self._stream = stream
        self._failure: str | None = None
        self.unusable: str | None = None
        self._announced = False
        self.layout: JitLayout | None = None
        try:
            self.layout = jit_layout([spec.path for spec in plan.leaves], leaves)
        except OffloadError as error:
            self.unusable = str(error)
            return
        devices = self.layout.mesh.local_devices
        self._keys = sharding.block_keys(plan, devices)
        self._rendezvous = Rendezvous(len(devices), peer_timeout)

    def trace(
        self, grads: Sequence[jax.Array], params: Sequence[jax.Array] | None, step: jax.Array, uniform: Uniform
    ) -> list:
        """Traces one update as a host callback per device; returns the update leaves, sharded as the params.

        Raises:
          OffloadError: the params' layout cannot run inside jit; the message says what to change.
        """
        if self.layout is None:
            raise OffloadError(self.unusable)
        self._announce()
        shapes = self.layout.block_shapes([spec.shape for spec in self._plan.leaves])
        out_blocks = [jax.ShapeDtypeStruct(shape, update_dtype(self._plan, i)) for i, shape in enumerate(shapes)]
        return host_update(self.layout, self._on_device, grads, params, step, uniform, out_blocks)

    def _announce(self) -> None:
        """Says once, on the ``jax_mlp`` logger, where a traced update runs and what the split step gains.

        WARNING when the params live on an accelerator: there the split step keeps the update on the
        device, while this route moves every step's grads, params and updates through the host and
        runs the update on its CPU. INFO on CPU, where both routes run the update on the same CPU and
        this one only adds the copies (1.25-2.9x the split step's time in ``benchmarks/routes.py``).
        """
        if self._announced:
            return
        self._announced = True
        platform = self.layout.mesh.devices.flat[0].platform
        logger.log(
            logging.INFO if platform == "cpu" else logging.WARNING,
            "mlp_offload: update was traced inside jit, so it runs on the host CPU (the params are on %s): each "
            "step copies the grads, params and updates between the devices and the host and runs the whole update "
            "on the CPU, and the first step compiles the update for the CPU. The split step is faster, most of all "
            "on an accelerator: jit the loss and gradients, and call tx.update (nnx.Optimizer.update, "
            "TrainState.apply_gradients) outside jit, where the update runs on the params' device. See "
            "docs/usage.md, 'Which route runs where'",
            platform,
        )

    def _on_device(
        self, step: np.ndarray, device_index: np.ndarray, uniform: Uniform, *blocks: np.ndarray
    ) -> list[np.ndarray]:
        """One device's host callback: meets the others, then returns its blocks of the updates."""
        device = self.layout.mesh.devices.flat[int(device_index)]
        on_host = functools.partial(self._on_host, int(step), uniform)  # every device brings the same uniform
        results = self._rendezvous.meet(int(step), device.id, blocks, on_host)
        return [results[key] for key in self._keys[device.id]]

    def _on_host(
        self, step: int, uniform: Uniform, blocks_by_device: dict[int, Sequence[np.ndarray]]
    ) -> dict[BlockKey, np.ndarray]:
        """The whole update on the host CPU backend, with every device's grad (and param) blocks.

        Runs in the callback of the last device to arrive. An error leaves step ``step`` intact and
        this route refusing further updates (the jitted caller cannot roll back with it): close the
        offloader and reopen it with ``resume=True``.

        Returns:
          Each owned block's update as a numpy array, by (leaf, owner device id).
        """
        if self._failure is not None:
            raise OffloadError(
                f"an earlier in-jit update of this mlp_offload failed ({self._failure}); its step is intact "
                "on storage: close this mlp_offload and create it again with resume=True"
            )
        try:
            blocks = self._blocks_on(self.layout.host, blocks_by_device, uniform)
            with jax.default_device(self.layout.host):
                results = self._stream.update(step, blocks, IN_CALLBACK)
        except BaseException as error:
            self._failure = f"{type(error).__name__}: {error}"
            raise
        return {key: np.asarray(value) for key, value in results.items()}  # this thread waits: see step.IN_CALLBACK

    def _blocks_on(
        self, host: jax.Device, blocks_by_device: dict[int, Sequence[np.ndarray]], uniform: Uniform
    ) -> Blocks:
        """Every device's owned grad (and param) blocks, put on the host CPU device, where every subgroup runs."""
        plan = self._plan
        n = len(plan.leaves)
        whole = next(iter(blocks_by_device))  # the device of leaves on one device (a one-device mesh)
        keys = {(p.leaf, p.device) for subgroup in plan.subgroups for p in subgroup.pieces}

        def put(offset: int) -> dict[BlockKey, jax.Array]:
            on_device = {key: blocks_by_device[whole if key[1] is None else key[1]] for key in keys}
            return {key: jax.device_put(values[offset + key[0]], host) for key, values in on_device.items()}

        params = put(n) if len(blocks_by_device[whole]) > n else None
        staging = Staging(plan, [DEVICE_MEMORY] * n)  # the callbacks' arrays, all put on the host CPU device
        return Blocks(put(0), params, [host] * len(plan.subgroups), uniform, staging)

    def settle(self) -> None:
        """Waits for the jitted updates still queued on the devices, so none meets closed tiers.

        A failed one has raised in its own results already; here it only must not stop the close.
        """
        if self.layout is None:
            return
        try:
            jax.effects_barrier()
        except Exception:
            logger.debug("a jitted update failed before close; its results carry the error", exc_info=True)
