"""The plan: which leaves, local shards or row chunks make up each subgroup, and each record's layout.

A subgroup is a set of *pieces*: whole leaves, the shards of a sharded leaf that this process owns,
or row chunks along axis 0 of either when larger than the subgroup size. A subgroup's pieces all live
on one device, where its update runs. Pieces are packed in the *natural order* of the leaves' names
(numbers compared as numbers: ``l2`` before ``l10``, ``Dense_9`` before ``Dense_10``), which is the
order users name their layers in, so a subgroup holds neighbouring layers and its grads arrive
together in the backward; ``tree`` order (keys sorted as strings) is kept for runs planned before.
Its *view* is the user's full tree with ``None`` in place of every leaf outside the
subgroup, so masks and per-leaf optimizers see the tree they were written for. The inner optimizer's
state for a view is exactly ``inner.init(view)``; its flattened leaves (plus master params, if any)
are laid out back to back, 64-byte aligned, in the subgroup's record payload: its
:class:`~jax_mlp._src.storage.record.RecordLayout`, which :func:`~jax_mlp._src.storage.record.pack` fills.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import jax
import numpy as np
import optax

from jax_mlp._src.errors import OffloadError
from jax_mlp._src.plan import remainders
from jax_mlp._src.storage.record import Field, RecordLayout

ALIGN = 64

LeafOrder = Literal["natural", "tree"]
"""How pieces are packed into subgroups: by the leaves' names with numbers compared as numbers, or in the
flattened tree's order (keys sorted as strings: ``l10`` before ``l2``), as every plan before 0.3 was."""


class LeafSpec(NamedTuple):
    """A param leaf as the plan knows it: its tree path (for messages), shape and dtype."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype


class Shard(NamedTuple):
    """The block of a sharded leaf that one device of this process holds, stores and updates."""

    box: tuple[tuple[int, int], ...]  # [start, stop) per dimension, in the leaf's coordinates
    device: int  # the jax device id

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.box)


class Piece(NamedTuple):
    """A leaf's data for one update: the whole leaf, or its ``shard``; all of it, or ``rows``.

    ``rows`` is ``[start, stop)`` along axis 0 of the shard (or of the leaf when not sharded).
    """

    leaf: int
    rows: tuple[int, int] | None = None
    shard: Shard | None = None

    @property
    def device(self) -> int | None:
        """The device id the piece lives on, or None for a leaf on a single device."""
        return None if self.shard is None else self.shard.device


class Subgroup(NamedTuple):
    """The unit of streaming: a few pieces and the layout of their record."""

    index: int
    pieces: tuple[Piece, ...]
    layout: RecordLayout


class Plan(NamedTuple):
    """The partition of one param tree for one inner optimizer."""

    treedef: Any
    leaves: tuple[LeafSpec, ...]
    subgroups: tuple[Subgroup, ...]
    master_dtype: np.dtype | None
    layout_hash: bytes
    leaf_order: LeafOrder = "natural"

    @property
    def state_nbytes(self) -> int:
        """Bytes of all record payloads: the whole offloaded state."""
        return sum(sg.layout.nbytes for sg in self.subgroups)


def piece_shape(spec: LeafSpec, piece: Piece) -> tuple[int, ...]:
    """The shape of a piece of the leaf ``spec``."""
    shape = spec.shape if piece.shard is None else piece.shard.shape
    if piece.rows is None:
        return shape
    return (piece.rows[1] - piece.rows[0], *shape[1:])


Box = tuple[tuple[int, int], ...]
"""A region of an array: ``[start, stop)`` per dimension."""


def shard_box(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    """A shard's ``index`` (slices, as jax gives them) as ``[start, stop)`` per dimension."""
    return tuple((sl.start or 0, size if sl.stop is None else sl.stop) for sl, size in zip(index, shape, strict=True))


def block_owners(shape: tuple[int, ...], sharding: Any, shards: Sequence[Shard]) -> dict[Any, int]:
    """Each device of this process that holds a block of a sharded leaf, and the id of its block's owner.

    Args:
      shape: the leaf's global shape.
      sharding: the leaf's sharding.
      shards: the leaf's :func:`owned_shards`.

    Returns:
      The owner's device id by device, in the order of ``sharding.addressable_devices_indices_map``;
      an owner maps to itself, a replica to the device that stores and updates its block.
    """
    owner_of_box = {shard.box: shard.device for shard in shards}
    return {
        device: owner_of_box[shard_box(index, shape)]
        for device, index in sharding.addressable_devices_indices_map(shape).items()
    }


def owned_shards(leaf: Any) -> tuple[Shard, ...] | None:
    """The shards of ``leaf`` this process stores and updates, or None for a leaf on one device.

    Of the replicas of a block held by this process's devices, the one with the lowest
    ``replica_id`` owns it; the others receive its update. A block replicated on other processes is
    owned there too: each process updates the blocks it holds, so no update waits on a peer.
    ``leaf`` is an array or a ``jax.ShapeDtypeStruct`` with a sharding (a restore's params).
    """
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(leaf, jax.Array | jax.ShapeDtypeStruct) or sharding is None or len(sharding.device_set) == 1:
        return None
    owners: dict[tuple, Any] = {}
    process = jax.process_index()
    # Replica ids count the devices holding a block in this order (jax's device_replica_id_map).
    for device, index in sharding.devices_indices_map(tuple(leaf.shape)).items():
        box = shard_box(index, tuple(leaf.shape))
        if device.process_index == process and box not in owners:
            owners[box] = device
    return tuple(Shard(box, device.id) for box, device in sorted(owners.items(), key=lambda kv: kv[1].id))


def paths_of(tree: Any) -> list[str]:
    """The ``keystr`` path of each leaf of ``tree``, in leaf order."""
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def treedef_paths(treedef: Any) -> list[str]:
    """The ``keystr`` path of each leaf of any tree of structure ``treedef`` (a record's state fields)."""
    return paths_of(jax.tree_util.tree_unflatten(treedef, [0] * treedef.num_leaves))


def view_of(treedef: Any, num_leaves: int, pieces: Sequence[Piece], piece_values: Sequence[Any]) -> Any:
    """The user's tree with ``piece_values`` at their pieces' leaves and ``None`` elsewhere."""
    leaves: list[Any] = [None] * num_leaves
    for piece, value in zip(pieces, piece_values, strict=True):
        leaves[piece.leaf] = value
    return jax.tree_util.tree_unflatten(treedef, leaves)


def init_shapes(inner: optax.GradientTransformation, view: Any) -> Any:
    """The shapes of ``inner.init(view)``, for a view with ``None`` in place of some leaves.

    Raises:
      OffloadError: ``inner.init`` fails on such a view (``optax.contrib.galore`` treats ``None`` as
        a leaf), so the optimizer cannot be run one subgroup at a time.
    """
    try:
        return jax.eval_shape(inner.init, view)
    except Exception as error:
        first_line = (str(error).splitlines() or [""])[0]
        raise OffloadError(
            f"inner.init fails on the view of a subgroup, the params with None in place of the leaves outside it "
            f"({type(error).__name__}: {first_line}); mlp_offload needs an optimizer that skips None leaves, as "
            "optax's tree maps do. Run this optimizer in memory, without mlp_offload, or use a leaf-wise optimizer"
        ) from error


def _abstract_pieces(plan_leaves: Sequence[LeafSpec], pieces: Sequence[Piece], dtype: np.dtype | None) -> list:
    return [
        jax.ShapeDtypeStruct(piece_shape(plan_leaves[p.leaf], p), dtype or plan_leaves[p.leaf].dtype) for p in pieces
    ]


def _master_shapes(plan_leaves: Sequence[LeafSpec], pieces: Sequence[Piece], dtype: np.dtype, storage: str) -> list:
    """Each piece's master field: the master dtype, or int16 remainders (see :mod:`jax_mlp._src.plan.remainders`)."""
    return [
        jax.ShapeDtypeStruct(
            piece_shape(plan_leaves[p.leaf], p),
            remainders.stored_master_dtype(plan_leaves[p.leaf].dtype, dtype, storage),
        )
        for p in pieces
    ]


def _tree_nbytes(tree: Any) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _layout(state_shapes: Any, master_shapes: Sequence[Any]) -> RecordLayout:
    state_leaves, state_treedef = jax.tree_util.tree_flatten(state_shapes)
    offset = 0
    fields = []
    for x in [*state_leaves, *master_shapes]:
        field = Field(tuple(x.shape), np.dtype(x.dtype), offset)
        fields.append(field)
        offset = _align(offset + field.nbytes)
    n_state = len(state_leaves)
    return RecordLayout(state_treedef, tuple(fields[:n_state]), tuple(fields[n_state:]), offset)


class _Estimator:
    """Per-piece bytes of optimizer state, from ``inner.init`` on one-piece views (shapes only)."""

    def __init__(
        self, inner: optax.GradientTransformation, treedef: Any, specs: Sequence[LeafSpec], master_dtype, storage: str
    ):
        self._inner, self._treedef, self._specs, self._master_dtype = inner, treedef, specs, master_dtype
        self._storage = storage
        self._base = self._state_nbytes([])
        self._by_signature: dict[tuple, int] = {}

    def _state_nbytes(self, pieces: Sequence[Piece]) -> int:
        values = _abstract_pieces(self._specs, pieces, self._master_dtype)
        view = view_of(self._treedef, len(self._specs), pieces, values)
        return _tree_nbytes(init_shapes(self._inner, view))

    def piece_nbytes(self, piece: Piece) -> int:
        """Bytes of state (and master) of a whole piece; pieces of one shape share the estimate."""
        spec = self._specs[piece.leaf]
        shape = piece_shape(spec, piece)
        signature = (shape, spec.dtype)
        if signature not in self._by_signature:
            self._by_signature[signature] = self._state_nbytes([piece]) - self._base
        master = 0
        if self._master_dtype is not None:
            stored = remainders.stored_master_dtype(spec.dtype, self._master_dtype, self._storage)
            master = math.prod(shape) * stored.itemsize
        return self._by_signature[signature] + master


def _natural_key(path: str) -> tuple:
    """``path`` with its runs of digits as numbers: ``['l2']`` sorts before ``['l10']``."""
    parts = re.split(r"(\d+)", path)
    return tuple(int(part) if index % 2 else part for index, part in enumerate(parts))  # digits at odd places


def _whole_pieces(
    specs: Sequence[LeafSpec], shards: Sequence[tuple[Shard, ...] | None], leaf_order: LeafOrder
) -> list[Piece]:
    """Every leaf, or every owned shard of a sharded leaf, grouped by device (leaves on one device first),
    each device's in ``leaf_order``."""
    leaves = range(len(specs))
    if leaf_order == "natural":
        leaves = sorted(leaves, key=lambda leaf: _natural_key(specs[leaf].path))
    pieces = [
        Piece(index) if shards[index] is None else Piece(index, shard=shard)
        for index in leaves
        for shard in (shards[index] or [None])
    ]
    return sorted(pieces, key=lambda p: -1 if p.device is None else p.device)


def group_pieces(
    specs: Sequence[LeafSpec],
    pieces: Sequence[Piece],
    estimator: Any,
    subgroup_size: int,
    whole_leaves: frozenset[int] = frozenset(),
    unit_of: Sequence[int] | None = None,
) -> list[list[Piece]]:
    """Greedy packing in order, never mixing devices or units; a piece above ``subgroup_size`` is cut into row chunks.

    A piece of a leaf in ``whole_leaves`` is never cut: above ``subgroup_size``, it is a subgroup of its own.
    ``unit_of`` gives each leaf's unit (a layer of a layer-streamed model), or None for one unit.
    ``estimator.piece_nbytes(piece)`` gives a whole piece's bytes in a record (``jax-mlp plan`` packs a model's
    leaves with its own).
    """
    unit_of = unit_of or [0] * len(specs)
    groups: list[list[Piece]] = []
    current: list[Piece] = []
    current_bytes = 0
    for whole in pieces:
        first = current[0] if current else None
        if first is not None and (first.device != whole.device or unit_of[first.leaf] != unit_of[whole.leaf]):
            groups.append(current)
            current, current_bytes = [], 0
        nbytes = estimator.piece_nbytes(whole)
        shape = piece_shape(specs[whole.leaf], whole)
        rows = shape[0] if shape else 1
        if nbytes > subgroup_size and whole.leaf in whole_leaves:
            groups.extend([current, [whole]] if current else [[whole]])
            current, current_bytes = [], 0
            continue
        if nbytes > subgroup_size and rows > 1:
            if current:
                groups.append(current)
            rows_per_chunk = max(1, subgroup_size * rows // nbytes)
            starts = range(0, rows, rows_per_chunk)
            groups.extend([[whole._replace(rows=(s, min(s + rows_per_chunk, rows)))] for s in starts][:-1])
            last_start = starts[-1]
            current = [whole._replace(rows=(last_start, rows))]
            current_bytes = nbytes * (rows - last_start) // rows
            continue
        if current and current_bytes + nbytes > subgroup_size:
            groups.append(current)
            current, current_bytes = [], 0
        current.append(whole)
        current_bytes += nbytes
    if current:
        groups.append(current)
    return groups


def _refuse_cut_whole_leaves(
    specs: Sequence[LeafSpec], shards: Sequence[tuple[Shard, ...] | None], whole_leaves: frozenset[int]
) -> None:
    """Raises for a leaf that must stay whole but is sharded into blocks: each block is updated on its own.

    A leaf replicated on several devices is still whole in each block, and is accepted.
    """
    for leaf in sorted(whole_leaves):
        spec, leaf_shards = specs[leaf], shards[leaf]
        full = tuple((0, size) for size in spec.shape)
        cut = next((shard for shard in leaf_shards or () if shard.box != full), None)
        if cut is not None:
            raise OffloadError(
                f"param {spec.path} {spec.shape} is sharded into blocks such as {cut.box}, but its optimizer mixes "
                "its rows (adafactor, lamb, lars and muon do), so each block updated on its own would give other "
                f"values than in memory; replicate {spec.path}, or use an element-wise optimizer for it"
            )


def oversized_whole_leaves(plan: Plan, whole_leaves: frozenset[int], subgroup_size: int) -> dict[str, int]:
    """Each leaf of ``whole_leaves`` that, kept whole, exceeds ``subgroup_size``: its path, and its subgroup's index.

    Such a leaf is a subgroup of its own (see :func:`make_plan`).
    """
    return {
        plan.leaves[sg.pieces[0].leaf].path: sg.index
        for sg in plan.subgroups
        if len(sg.pieces) == 1 and sg.pieces[0].leaf in whole_leaves and sg.layout.nbytes > subgroup_size
    }


def _hash_plan(treedef: Any, specs: Sequence[LeafSpec], subgroups: Sequence[Subgroup], master_dtype) -> bytes:
    digest = hashlib.sha256()
    digest.update(repr(treedef).encode())
    digest.update(repr([(s.path, s.shape, str(s.dtype)) for s in specs]).encode())
    digest.update(str(master_dtype).encode())
    for sg in subgroups:
        digest.update(repr(sg.pieces).encode())
        digest.update(repr(sg.layout.state_treedef).encode())
        digest.update(repr([(f.shape, str(f.dtype), f.offset) for f in sg.layout.state_fields]).encode())
        digest.update(repr([(f.shape, str(f.dtype), f.offset) for f in sg.layout.master_fields]).encode())
    return digest.digest()[:16]


def make_plan(
    params: Any,
    inner: optax.GradientTransformation,
    subgroup_size: int,
    master_dtype: np.dtype | None = None,
    shards: Sequence[tuple[Shard, ...] | None] | None = None,
    *,
    whole_leaves: frozenset[int] = frozenset(),
    master_storage: str = "full",
    unit_of: Sequence[int] | None = None,
    leaf_order: LeafOrder = "natural",
) -> Plan:
    """Partitions ``params`` into subgroups of about ``subgroup_size`` bytes of offloaded state.

    Only shapes and dtypes are used: nothing is computed or allocated.

    Args:
      params: the param pytree (arrays or ``jax.ShapeDtypeStruct``s).
      inner: the element-wise optax optimizer whose state is offloaded.
      subgroup_size: target bytes of optimizer state plus master params per subgroup.
      master_dtype: dtype of the master params stored with the state, or None for no master copy.
      shards: per leaf, the shards this process owns (see :func:`owned_shards`), or None for a leaf
        on one device; None for no sharded leaves.
      whole_leaves: indices (in ``tree_leaves`` order) of leaves whose optimizer mixes their rows
        (see :func:`jax_mlp._src.plan.optimizer_check.check_optimizer`): they are never cut into row chunks, and
        one above ``subgroup_size`` is a subgroup of its own.
      master_storage: ``"remainder"`` to store the fp32 master of bf16 leaves as int16 remainders,
        ``"full"`` to store it whole (see :class:`~jax_mlp._src.config.OffloadConfig`).
      unit_of: each leaf's unit, in ``tree_leaves`` order (the layers of a layer-streamed model): no
        subgroup holds pieces of two units, and the leaves of a unit must be contiguous in ``leaf_order``.
        None: one unit.
      leaf_order: the order pieces are packed in (see :data:`LeafOrder`); ``"tree"`` to resume a run planned
        before 0.3.

    Returns:
      The plan, with each subgroup's record layout and a hash identifying the whole layout.

    Raises:
      OffloadError: a leaf of ``whole_leaves`` is sharded into blocks smaller than the leaf.
    """
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    specs = tuple(
        LeafSpec(jax.tree_util.keystr(path), tuple(leaf.shape), np.dtype(leaf.dtype)) for path, leaf in path_leaves
    )
    shards = shards or [None] * len(specs)
    _refuse_cut_whole_leaves(specs, shards, whole_leaves)
    estimator = _Estimator(inner, treedef, specs, master_dtype, master_storage)
    whole = _whole_pieces(specs, shards, leaf_order)
    subgroups = []
    for index, grouped in enumerate(group_pieces(specs, whole, estimator, subgroup_size, whole_leaves, unit_of)):
        pieces = sorted(grouped, key=lambda piece: piece.leaf)  # a subgroup's pieces in tree order, as its view's
        state_pieces = _abstract_pieces(specs, pieces, master_dtype)
        view = view_of(treedef, len(specs), pieces, state_pieces)
        state_shapes = init_shapes(inner, view)
        master_shapes = [] if master_dtype is None else _master_shapes(specs, pieces, master_dtype, master_storage)
        subgroups.append(Subgroup(index, tuple(pieces), _layout(state_shapes, master_shapes)))
    layout_hash = _hash_plan(treedef, specs, subgroups, master_dtype)
    return Plan(treedef, specs, tuple(subgroups), master_dtype, layout_hash, leaf_order)
