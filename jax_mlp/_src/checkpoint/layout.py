"""The standard optax layout of a plan's state, and where each field of each record lies in it.

A checkpoint holds the tree ``inner.init(params)`` returns (with master params, ``{"opt_state": ...,
"master": ...}``), while the tiers hold it as records, one per subgroup, each a few row chunks or
blocks of some leaves. This module maps one onto the other: every record field to a leaf of the
standard layout and a box in it, and every leaf to zarr3 chunks no two writers share.
:mod:`jax_mlp._src.checkpoint.handler` streams the records through these regions.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_mlp._src.errors import OffloadError
from jax_mlp._src.plan import partition
from jax_mlp._src.plan.partition import Box, Plan, Subgroup
from jax_mlp._src.storage.record import CHUNK_BYTES

MASTER = "master"
PARAMS = "params"
STATE = "opt_state"
_MIN_CHUNK_BYTES = 2**20  # chunks aligned with every region are kept down to this size


def standard_layout(
    inner: optax.GradientTransformation, params: Any, master_dtype: Any = None, *, with_params: bool = False
) -> Any:
    """The tree a checkpoint of ``mlp_offload(inner, master_dtype=...)`` holds, as ``jax.ShapeDtypeStruct``s.

    Pass it to ``ocp.args.StandardRestore`` to restore such a checkpoint into plain optax. Params
    sharded with ``NamedSharding`` on one mesh give a sharded layout: each state leaf of a param is
    sharded like it, and the others (adam's ``count``) are replicated on that mesh.

    Args:
      inner: the optimizer wrapped by ``mlp_offload``.
      params: the params (arrays or ``jax.ShapeDtypeStruct``s).
      master_dtype: the ``master_dtype`` given to ``mlp_offload``, or None.
      with_params: the checkpoint holds the params too, as one of ``stream_layers`` does (its params
        live in the tiers): ``params`` is then the model tree ``{"layers": [layer_0, ...], "outer": outer}``.

    Returns:
      ``jax.eval_shape(inner.init, params)`` without master params; with them,
      ``{"opt_state": <the same on params in master_dtype>, "master": <params in master_dtype>}``. With
      ``with_params``, always a dict with ``"opt_state"``, ``"params"`` (in their dtype) and, with master
      params, ``"master"``.

    Example:
      >>> import jax.numpy as jnp, optax, jax_mlp
      >>> jax_mlp.standard_layout(optax.sgd(0.1, momentum=0.9), {"w": jnp.zeros(3)})[0].trace
      {'w': ShapeDtypeStruct(shape=(3,), dtype=float32)}
    """
    dtype = None if master_dtype is None else np.dtype(master_dtype)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), dtype or x.dtype), params)
    own = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    state = jax.eval_shape(inner.init, shapes)
    mesh = _one_mesh(params)
    if mesh is not None:
        state = _sharded_like(state, params, mesh)
        shapes, own = (
            jax.tree.map(lambda s, x: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=x.sharding), tree, params)
            for tree in (shapes, own)
        )
    if not with_params:
        return state if dtype is None else {STATE: state, MASTER: shapes}
    return {STATE: state, PARAMS: own} if dtype is None else {STATE: state, PARAMS: own, MASTER: shapes}


def _one_mesh(params: Any) -> jax.sharding.Mesh | None:
    """The mesh every leaf of ``params`` is sharded on with a ``NamedSharding``, or None."""
    shardings = [getattr(x, "sharding", None) for x in jax.tree.leaves(params)]
    meshes = {s.mesh for s in shardings if isinstance(s, NamedSharding)}
    named = all(isinstance(s, NamedSharding) for s in shardings)
    return meshes.pop() if named and len(meshes) == 1 and isinstance(next(iter(meshes)), jax.sharding.Mesh) else None


def _sharded_like(state: Any, params: Any, mesh: jax.sharding.Mesh) -> Any:
    """``state`` with each leaf sharded like the param whose path ends its own (and shape matches), else replicated."""
    by_path = {jax.tree_util.keystr(path): x for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}

    def place(path: Any, leaf: Any) -> jax.ShapeDtypeStruct:
        name = jax.tree_util.keystr(path)
        matches = [p for p, x in by_path.items() if name.endswith(p) and tuple(x.shape) == tuple(leaf.shape)]
        sharding = by_path[max(matches, key=len)].sharding if matches else NamedSharding(mesh, P())
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(place, state)


class Region(NamedTuple):
    """Where one field of a record lives in the standard layout."""

    leaf: int
    box: Box | None  # None: the whole leaf
    shared: bool  # the same in every subgroup (adam's count): saved once, restored into each
    param: int | None  # the param leaf whose block ``box`` is in, when it is one


class _Lookup(NamedTuple):
    """What mapping a record's fields to the standard layout needs to know."""

    index: dict[str, int]  # leaf position by tree path
    shapes: tuple[tuple[int, ...], ...]
    prefix: str  # of inner state paths: "['opt_state']" where the tree has other parts
    parts: frozenset[str]  # those parts: "['master']", "['params']"
    shared: frozenset[str]  # inner state paths every subgroup holds alike
    owner: dict[str, int]  # inner state path -> the split or sharded param leaf it belongs to


class Layout(NamedTuple):
    """The standard layout of one plan: its leaves, and where each record field maps into them."""

    treedef: Any
    leaves: tuple[jax.ShapeDtypeStruct, ...]
    names: tuple[str, ...]
    regions: tuple[tuple[Region, ...], ...]


def abstract_params(plan: Plan) -> Any:
    """The params of ``plan`` as ``jax.ShapeDtypeStruct``s, in its tree."""
    leaves = [jax.ShapeDtypeStruct(spec.shape, spec.dtype) for spec in plan.leaves]
    return jax.tree_util.tree_unflatten(plan.treedef, leaves)


def _state_paths(inner: optax.GradientTransformation, plan: Plan, pieces: Sequence[partition.Piece]) -> list[str]:
    """The tree paths of the inner state of a view holding the whole leaves of ``pieces``."""
    dtype = plan.master_dtype
    values = [jax.ShapeDtypeStruct(plan.leaves[p.leaf].shape, dtype or plan.leaves[p.leaf].dtype) for p in pieces]
    view = partition.view_of(plan.treedef, len(plan.leaves), pieces, values)
    return partition.paths_of(jax.eval_shape(inner.init, view))


def _piece_box(spec: partition.LeafSpec, piece: partition.Piece) -> Box | None:
    """Where a piece lies in its leaf: its shard, narrowed to its rows; None for a whole leaf on one device."""
    if piece.shard is None and piece.rows is None:
        return None
    box = piece.shard.box if piece.shard is not None else tuple((0, n) for n in spec.shape)
    if piece.rows is None:
        return box
    (start, _), *rest = box
    return ((start + piece.rows[0], start + piece.rows[1]), *rest)


def _box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def _state_box(field_shape: tuple[int, ...], full: tuple[int, ...], param: partition.LeafSpec, box: Box | None):
    """Where a state field of a block lies in its array: the param's box, or its rows of a per-row state.

    A state shaped like its param takes the param's box. A state with other trailing axes, whose rows
    are the param's rows (``quantized_state``'s codes and scales), takes the box's rows whole, as long
    as the block is cut along rows only. Anything else keeps the box, and is refused by the caller.
    """
    if box is None or field_shape == _box_shape(box) or not full or full[0] != param.shape[0]:
        return box
    (start, stop), *rest = box
    rows_only = tuple(rest) == tuple((0, n) for n in param.shape[1:])
    if rows_only and field_shape == (stop - start, *full[1:]):
        return ((start, stop), *((0, n) for n in full[1:]))
    return box


def _regions(plan: Plan, subgroup: Subgroup, lookup: _Lookup) -> tuple[Region, ...]:
    """Maps each field of ``subgroup``'s record to its leaf and region in the standard layout."""
    owner = lookup.owner
    box_of = {p.leaf: _piece_box(plan.leaves[p.leaf], p) for p in subgroup.pieces}
    state_paths = partition.treedef_paths(subgroup.layout.state_treedef)
    regions = []
    for path, field in zip(state_paths, subgroup.layout.state_fields, strict=True):
        leaf = lookup.index[lookup.prefix + path]
        full = lookup.shapes[leaf]
        box = _state_box(field.shape, full, plan.leaves[owner[path]], box_of[owner[path]]) if path in owner else None
        if field.shape != (full if box is None else _box_shape(box)):
            param = plan.leaves[owner[path]]
            raise OffloadError(
                f"optimizer state leaf {path} of the split or sharded param {param.path} has shape {field.shape} for "
                f"its block {box}, not that block of its shape {full}, so it has no standard layout (adafactor's "
                f"factored moments do this); checkpoint with {param.path} whole: on one device, and a subgroup_size "
                "that does not split it"
            )
        regions.append(Region(leaf, box, path in lookup.shared, owner.get(path)))
    for part in (MASTER, PARAMS):  # where the tree has them: a master copy, and the params of a layer stream
        for piece in subgroup.pieces if f"['{part}']" in lookup.parts else ():
            name = f"['{part}']{plan.leaves[piece.leaf].path}"
            regions.append(Region(lookup.index[name], box_of[piece.leaf], False, piece.leaf))
    return tuple(regions)


@functools.lru_cache(maxsize=8)
def layout_of(inner: optax.GradientTransformation, plan: Plan, with_params: bool = False) -> Layout:
    """The standard layout of ``plan``, and the region of every record field in it.

    Each subgroup's regions are its state fields', then its master fields', then, ``with_params``,
    its params' (one per piece: a layer stream's params record).

    Cached: it traces ``inner.init`` once per split or sharded leaf, and every save of a run needs it.
    """
    tree = standard_layout(inner, abstract_params(plan), plan.master_dtype, with_params=with_params)
    path_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    names = tuple(jax.tree_util.keystr(path) for path, _ in path_leaves)
    leaves = tuple(leaf for _, leaf in path_leaves)
    shared = frozenset(_state_paths(inner, plan, []))
    parted = sorted({p.leaf for sg in plan.subgroups for p in sg.pieces if p.rows is not None or p.shard is not None})
    owner = {
        path: leaf
        for leaf in parted
        for path in _state_paths(inner, plan, [partition.Piece(leaf)])
        if path not in shared
    }
    held = ((MASTER, plan.master_dtype is not None), (PARAMS, with_params))
    parts = frozenset(f"['{part}']" for part, present in held if present)
    prefix = f"['{STATE}']" if parts else ""
    index = {name: i for i, name in enumerate(names)}
    lookup = _Lookup(index, tuple(x.shape for x in leaves), prefix, parts, shared, owner)
    regions = tuple(_regions(plan, sg, lookup) for sg in plan.subgroups)
    return Layout(jax.tree_util.tree_structure(tree), leaves, names, regions)


def slices(box: Box) -> tuple[slice, ...]:
    """``box`` as an index expression."""
    return tuple(slice(start, stop) for start, stop in box)


def region_of(array: Any, region: Region) -> Any:
    """The part of a standard-layout leaf that ``region`` covers."""
    return array if region.box is None else array[slices(region.box)]


def interior_gcd(bounds: Sequence[int], size: int) -> int:
    """The gcd of the boundaries strictly inside ``[0, size)``; 0 when there are none."""
    return math.gcd(*(b for b in bounds if 0 < b < size))


def chunk_shape(shape: tuple[int, ...], itemsize: int, blocks: Sequence[Box], rows_gcd: int) -> tuple[int, ...]:
    """The zarr3 chunk of a standard-layout array: no chunk spans two blocks, so no two writers share one.

    Along axis 0 it also divides every written region's boundaries (``rows_gcd``, over all
    processes) when that leaves chunks of at least ``_MIN_CHUNK_BYTES``; otherwise it takes the
    largest divisor of a block's rows up to ``CHUNK_BYTES`` (about a record's chunk), and the chunk a
    region boundary cuts is written twice, by the same process (tensorstore merges the two writes).
    """
    if not shape:
        return ()
    base = [interior_gcd([b for box in blocks for b in box[d]], n) or n for d, n in enumerate(shape)]
    aligned = math.gcd(base[0], rows_gcd)
    row_bytes = itemsize * math.prod(base[1:])
    if aligned == base[0] or aligned * row_bytes >= _MIN_CHUNK_BYTES:
        return (aligned, *base[1:])
    divisors = {d for k in range(1, math.isqrt(base[0]) + 1) if base[0] % k == 0 for d in (k, base[0] // k)}
    return (max([aligned, *(d for d in divisors if d * row_bytes <= CHUNK_BYTES)]), *base[1:])


def host_block(value: Any, box: Box | None) -> np.ndarray:
    """``value[box]`` on the host; of a sharded array, from the addressable shard holding it (no gather)."""
    if box is None:
        return np.asarray(value)
    if isinstance(value, jax.Array) and len(value.sharding.device_set) > 1:
        for shard in value.addressable_shards:
            held = partition.shard_box(shard.index, value.shape)
            if all(lo <= start and stop <= hi for (start, stop), (lo, hi) in zip(box, held, strict=True)):
                offsets = tuple((start - lo, stop - lo) for (start, stop), (lo, _) in zip(box, held, strict=True))
                return np.asarray(shard.data)[slices(offsets)]
    return np.asarray(value)[slices(box)]
