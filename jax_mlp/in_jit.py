"""The in-jit route: ``update`` traced inside ``jax.jit`` becomes one host callback.

Inside jit the state cannot stream through the device, so the grads (and params) go to the host
through ``io_callback``, inside ``shard_map`` over the params' one-device mesh, and the offloader
updates every subgroup on the host CPU backend, as ZeRO-Offload's CPU Adam does.

Params sharded over several devices are refused here: one callback per device, each running the
update of its shards on the host CPU backend, deadlocks XLA's CPU runtime on fake CPU devices (the
callbacks' host computations wait behind the devices' blocked steps), so the route cannot be tested
on CPU. Sharded params take the eager route, which is the fast one anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import io_callback
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P


class JitLayout(NamedTuple):
    """The device the params live on, and its one-device mesh for ``shard_map``."""

    device: jax.Device
    mesh: Mesh


def jit_layout(paths: Sequence[str], leaves: Sequence[Any]) -> JitLayout:
    """The layout of ``leaves`` for the in-jit route.

    Args:
      paths: each leaf's tree path, for errors.
      leaves: the params given to ``init`` (concrete arrays).

    Returns:
      The params' device (the default device for leaves that are not jax arrays) and its mesh.

    Raises:
      ValueError: a leaf spans several devices.
    """
    devices = set()
    for path, leaf in zip(paths, leaves, strict=True):
        if isinstance(leaf, jax.Array):
            if len(leaf.sharding.device_set) > 1:
                raise ValueError(
                    f"param {path} is sharded over {len(leaf.sharding.device_set)} devices; mlp_offload's update "
                    "inside jit takes params on one device. Call tx.update(grads, opt_state, params) outside jit: "
                    "the eager update handles sharded params and is the fast route (see docs/multi_device.md)"
                )
            devices.update(leaf.sharding.device_set)
    if len(devices) > 1:
        raise ValueError(
            "the params are on several devices; update inside jit takes them on one device: put them there, or "
            "call tx.update outside jit"
        )
    device = devices.pop() if devices else jax.devices()[0]
    return JitLayout(device, Mesh(np.array([device]), ("device",)))


def host_update(
    layout: JitLayout,
    update_on_host: Callable[..., list[np.ndarray]],
    grads: Sequence[jax.Array],
    params: Sequence[jax.Array] | None,
    step: jax.Array,
    out_leaves: Sequence[jax.ShapeDtypeStruct],
) -> list[jax.Array]:
    """Traces the update as one ``update_on_host(step, *grads, *params)`` callback.

    Args:
      layout: from :func:`jit_layout`.
      update_on_host: runs on the host; returns each leaf's update as a numpy array.
      grads: the gradient leaves (tracers).
      params: the param leaves, or None.
      step: the traced step of the ``OffloadState``.
      out_leaves: per leaf, the shape and dtype of its update.

    Returns:
      The update leaves.
    """
    params = list(params or [])

    def on_device(step, grads, params):
        return io_callback(update_on_host, list(out_leaves), step, *grads, *params)

    everywhere = [P()] * len(out_leaves)
    mapped = jax.shard_map(
        on_device,
        mesh=layout.mesh,
        in_specs=(P(), everywhere, everywhere if params else []),
        out_specs=everywhere,
        check_vma=False,
    )
    return mapped(step, list(grads), params)
