"""The plan of a layer-streamed model: its units (each layer, then the outer params), their subgroups, and
the records that hold their params; the order the update takes them in, and the host RAM a run needs.

A layer-streamed model is ``L`` layers of one shape (one layer's param tree, the same for each) and
the outer params (embedding, head, final norm). The inner optimizer sees one tree, the *model tree*
``{"layers": [layer_0, ..., layer_{L-1}], "outer": outer}``; its leaves are laid out unit by unit
(layer 0's leaves, ..., layer L-1's, then the outer ones), and :func:`~jax_mlp._src.plan.partition.make_plan`
never puts two units' pieces in one subgroup. Each subgroup has two records: its state record (index
``k``, as in every plan) and its **params record** (index ``S + k`` of ``S`` subgroups): its pieces'
params, which the forward and backward read and the update writes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jax_mlp._src import host_memory
from jax_mlp._src.config import OffloadConfig
from jax_mlp._src.errors import OffloadError
from jax_mlp._src.parsing import format_bytes
from jax_mlp._src.plan import partition
from jax_mlp._src.plan.partition import Plan, Subgroup
from jax_mlp._src.plan.sharding import LeafSharding
from jax_mlp._src.storage.buffers import POOL_BYTES
from jax_mlp._src.storage.record import Field, RecordLayout


class Unit(NamedTuple):
    """What the step brings to the device at once: one layer, or the outer params.

    Attributes:
      name: ``"layer 3"`` or ``"outer"``, for messages.
      leaves: its leaf indices in the model tree (contiguous).
      subgroups: its subgroups' indices, in plan order.
    """

    name: str
    leaves: range
    subgroups: tuple[int, ...]


class LayerPlan(NamedTuple):
    """The plan of a layer-streamed model.

    Attributes:
      plan: the subgroups of the model tree, none spanning two units.
      units: the layers in order, then the outer unit.
      layer_treedef: one layer's param tree.
      outer_treedef: the outer params' tree.
      param_layouts: each subgroup's params record, by subgroup index.
      sharding: each leaf's sharding and owned shards (a layer sharded over devices: FSDP).
    """

    plan: Plan
    units: tuple[Unit, ...]
    layer_treedef: Any
    outer_treedef: Any
    param_layouts: tuple[RecordLayout, ...]
    sharding: LeafSharding

    def devices(self, default: jax.Device) -> list[jax.Device]:
        """Per subgroup, where its programs run: its shards' device, or ``default`` for a leaf on one device."""
        by_id = {device.id: device for device in jax.devices()}
        return [default if sg.pieces[0].device is None else by_id[sg.pieces[0].device] for sg in self.plan.subgroups]

    @property
    def num_layers(self) -> int:
        return len(self.units) - 1

    @property
    def outer(self) -> Unit:
        return self.units[-1]

    def params_record(self, subgroup: int) -> int:
        """The record index of ``subgroup``'s params."""
        return len(self.plan.subgroups) + subgroup

    @property
    def layouts(self) -> tuple[RecordLayout, ...]:
        """Every record's layout by index: the state records, then the params records."""
        return tuple(sg.layout for sg in self.plan.subgroups) + self.param_layouts

    @property
    def param_nbytes(self) -> int:
        """Bytes of every params record's payload: the model's params as stored."""
        return sum(layout.nbytes for layout in self.param_layouts)


def model_tree(outer: Any, layers: Sequence[Any]) -> dict[str, Any]:
    """The tree the inner optimizer sees: ``{"layers": [layer_0, ...], "outer": outer}``."""
    return {"layers": list(layers), "outer": outer}


def layer_shapes(stacked: Any, num_layers: int | None = None) -> tuple[Any, int]:
    """One layer's param shapes, and the number of layers, from stacked layer params (leading axis: the layer).

    Raises:
      OffloadError: the leaves' leading axes differ, or are not ``num_layers`` when that is given.
    """
    leaves, treedef = jax.tree_util.tree_flatten(stacked)
    if not leaves:
        raise OffloadError("the stacked layer params have no leaves: give each layer's params stacked on axis 0")
    counts = {x.shape[0] if x.shape else None for x in leaves}
    if len(counts) != 1 or None in counts:
        paths = partition.paths_of(stacked)
        shapes = ", ".join(f"{p} {tuple(x.shape)}" for p, x in zip(paths, leaves, strict=True))
        raise OffloadError(
            f"the layers' params must be stacked on axis 0, one entry per layer, with the same count for every leaf; "
            f"got {shapes}: stack layers of one shape (as nnx.vmap, nn.scan or jnp.stack make them)"
        )
    count = counts.pop()
    if num_layers is not None and count != num_layers:
        raise OffloadError(f"the stacked layer params hold {count} layers, but num_layers={num_layers}")
    paths = partition.paths_of(stacked)
    one = [
        jax.ShapeDtypeStruct(tuple(x.shape[1:]), x.dtype, sharding=_one_layer_sharding(x, path))
        for x, path in zip(leaves, paths, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, one), count


def _one_layer_sharding(stacked: Any, path: str) -> jax.sharding.Sharding | None:
    """One layer's sharding of a stacked leaf sharded over several devices: its spec without the layer axis.

    Raises:
      OffloadError: the layer axis is sharded, or the sharding is not a ``NamedSharding``.
    """
    sharding = getattr(stacked, "sharding", None)
    if sharding is None or len(sharding.device_set) == 1:
        return None
    spec = getattr(sharding, "spec", None)
    if not isinstance(sharding, jax.sharding.NamedSharding) or (len(spec) and spec[0] is not None):
        raise OffloadError(
            f"the stacked layer param {path} is sharded as {sharding}; stream_layers streams each layer whole, so "
            "shard the layers' own axes with a NamedSharding and leave the layer axis (axis 0) unsharded, e.g. "
            "PartitionSpec(None, 'fsdp')"
        )
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[1:]), memory_kind="device")


def _check_processes(paths: Sequence[str], sharding: LeafSharding) -> None:
    """With several processes, every leaf must span all of them: the per-layer programs are global computations.

    Raises:
      OffloadError: a leaf on one device, or on some processes' devices only, naming it.
    """
    count = jax.process_count()
    if count == 1:
        return
    for path, leaf_sharding in zip(paths, sharding.shardings, strict=True):
        processes = set() if leaf_sharding is None else {d.process_index for d in leaf_sharding.device_set}
        if len(processes) < count:
            raise OffloadError(
                f"with {count} jax processes, every param of a layer-streamed model must be a jax.Array over devices "
                f"of every process, but {path} is {'on one device' if not processes else 'on some processes only'}: "
                "shard it or replicate it over a mesh of all the devices (e.g. NamedSharding(mesh, PartitionSpec()) "
                "for a replicated one)"
            )


def _param_layout(plan: Plan, subgroup: Subgroup) -> RecordLayout:
    """A params record: each piece's params in the param dtype, back to back, 64-byte aligned."""
    fields, offset = [], 0
    for piece in subgroup.pieces:
        spec = plan.leaves[piece.leaf]
        field = Field(partition.piece_shape(spec, piece), np.dtype(spec.dtype), offset)
        fields.append(field)
        offset = -(-(offset + field.nbytes) // partition.ALIGN) * partition.ALIGN
    return RecordLayout(jax.tree_util.tree_structure([0] * len(fields)), tuple(fields), (), offset)


def make_layer_plan(
    outer: Any,
    layer: Any,
    num_layers: int,
    make_plan: Any,
) -> LayerPlan:
    """The plan of ``num_layers`` layers of shapes ``layer`` and the ``outer`` params.

    Args:
      outer: the outer params, as arrays or ``jax.ShapeDtypeStruct``s.
      layer: one layer's params, as shapes (with the sharding of one layer, if sharded).
      num_layers: how many layers.
      make_plan: ``make_plan(model_tree, unit_of)``: the plan of the model tree with each leaf's unit
        (the offload's optimizer check and partition, given its options).

    Returns:
      The plan, whose subgroups each hold pieces of one unit.
    """
    layer_leaves, layer_treedef = jax.tree_util.tree_flatten(layer)
    outer_leaves, outer_treedef = jax.tree_util.tree_flatten(outer)
    per_layer = len(layer_leaves)
    tree = model_tree(outer, [layer] * num_layers)
    unit_of = [leaf // per_layer for leaf in range(per_layer * num_layers)] + [num_layers] * len(outer_leaves)
    plan = make_plan(tree, unit_of)
    units = []
    for index in range(num_layers + 1):
        leaves = (
            range(index * per_layer, (index + 1) * per_layer)
            if index < num_layers
            else range(num_layers * per_layer, num_layers * per_layer + len(outer_leaves))
        )
        subgroups = tuple(sg.index for sg in plan.subgroups if sg.pieces[0].leaf in leaves)
        units.append(Unit(f"layer {index}" if index < num_layers else "outer", leaves, subgroups))
    layouts = tuple(_param_layout(plan, sg) for sg in plan.subgroups)
    sharding = LeafSharding.of(jax.tree_util.tree_leaves(tree))
    _check_processes(partition.paths_of(tree), sharding)
    return LayerPlan(plan, tuple(units), layer_treedef, outer_treedef, layouts, sharding)


def update_order(plan: LayerPlan, *, deferred: bool = False) -> list[int]:
    """The order the update takes the subgroups in: the backward's (the layers last to first, then the outer
    unit), or, for an update deferred to the next forward, the forward's (the outer unit, then the layers)."""
    units = (plan.outer, *plan.units[:-1]) if deferred else (*plan.units[:-1][::-1], plan.outer)
    return [k for unit in units for k in unit.subgroups]


def stream_config(plan: LayerPlan, config: OffloadConfig) -> OffloadConfig:
    """The options the update's state stream runs with: nothing read between steps, and the state read one unit
    ahead of the update.

    A step's reads are the forward's params, then, in the backward, each unit's params and state. Read
    earlier (between steps, or further ahead), the state would queue before the params the forward and
    the backward wait on, and the update, whose writes bound the step, would start late.
    """
    one_unit = max(len(unit.subgroups) for unit in plan.units)
    return dataclasses.replace(config, idle_prefetch=False, prefetch_depth=min(config.prefetch_depth, one_unit))


def host_memory_needed(plan: LayerPlan, config: OffloadConfig, platform: str) -> dict[str, int]:
    """What a layer-streamed run adds to host RAM, by part (bytes): the host cache; the record buffers (those in
    flight, or the pool that keeps them for reuse, up to ``POOL_BYTES``); and the units staged: on a CPU
    backend, where device memory is host RAM, eight units' worth (the params of three units: the one
    computing, the one read ahead, the one handed to the update; the grads of two; the new params of one;
    and the host copies of the units read ahead), measured at 5.4 GiB resident for 4.5 GiB of params with a
    1.5 GiB cache; elsewhere the host copies of the two units read ahead."""
    sizes = [sum(plan.param_layouts[k].nbytes for k in unit.subgroups) for unit in plan.units]
    records = [sg.layout.nbytes for sg in plan.plan.subgroups] + [layout.nbytes for layout in plan.param_layouts]
    in_flight = 2 * (config.prefetch_depth + config.write_depth) * max(records)
    return {
        "host_cache": config.host_cache,
        "record buffers": max(in_flight, min(POOL_BYTES, sum(records))),
        "units staged": (8 if platform == "cpu" else 2) * max(sizes),
    }


def check_host_memory(plan: LayerPlan, config: OffloadConfig, platform: str) -> None:
    """Refuses, before anything is written, a run that would not fit under the memory cap of its cgroup.

    Raises:
      OffloadError: the cap is below the resident set now plus :func:`host_memory_needed`, naming each part.
    """
    cap = host_memory.memory_cap()
    if cap is None:
        return
    parts = {"resident now": host_memory.resident_bytes(), **host_memory_needed(plan, config, platform)}
    needed = sum(parts.values())
    if needed > cap:
        said = ", ".join(f"{name} {format_bytes(n)}" for name, n in parts.items())
        raise OffloadError(
            f"this process's memory cap (cgroup) is {format_bytes(cap)}, but the layer-streamed run needs about "
            f"{format_bytes(needed)} of host RAM ({said}); raise the cap, or lower host_cache, subgroup_size "
            "(the record buffers) or the layers' width (the units staged)"
        )
