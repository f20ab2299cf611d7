"""Device programs: the jitted init, update and apply of one subgroup, and the executable cache they share.

A subgroup's program sees the user's whole tree with ``None`` outside the subgroup (its *view*), so
masks and per-leaf optimizers keep their meaning. Programs are keyed by a :class:`SubgroupSpec`
and shared through :class:`Executables`: a model of 24 identical blocks compiles once.

The *shared* state is the inner state of a view with no leaves (counts, injected hyperparameters):
every subgroup holds a copy. The user's handle carries it; each update gives every subgroup the
handle's values and their successors alike (:class:`Uniform`), so a value set on the handle reaches
every subgroup, and every record's copy equals the handle's, bit for bit.
"""

from __future__ import annotations

import collections
import functools
import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from jax_mlp._src.errors import OffloadError
from jax_mlp._src.plan import partition, remainders
from jax_mlp._src.plan.partition import Piece, Plan, Subgroup


def update_dtype(plan: Plan, leaf: int) -> np.dtype:
    """The dtype a leaf's optimizer works in, and its updates come in: the master dtype, else the param's.

    With a master, the update is ``p_new - p`` in the master dtype (:func:`remainders.landing_update`),
    so ``p + u`` is exactly the new params ``p_new`` (the new master's bf16 word). Updates in the param's dtype would halve their bytes, but where
    a master shrinks below half of ``p`` in one step (near zero) ``p + u`` would then be several
    ulps off (0.8% of elements differing in ``tests/test_exactness.py``): the fused ``apply``
    is the lean route instead, writing the master's cast itself.
    """
    return np.dtype(plan.master_dtype) if plan.master_dtype is not None else plan.leaves[leaf].dtype


class SubgroupSpec(NamedTuple):
    """Everything a subgroup's computation depends on besides its input arrays (a jit static arg).

    Pieces are normalised to start at row 0 (the real start is a traced argument) and lose their
    shard (their arrays are the shard's block), so the chunks of one leaf share a compilation.
    """

    inner: optax.GradientTransformation
    treedef: Any
    num_leaves: int
    pieces: tuple[Piece, ...]
    dtypes: tuple[np.dtype, ...]
    state_treedef: Any
    master_dtype: np.dtype | None
    shared: tuple[int, ...]  # the position of each shared state leaf among the subgroup's state leaves
    remainders: tuple[bool, ...]  # per piece: its master is stored as int16 remainders (jax_mlp._src.plan.remainders)

    @classmethod
    def of(
        cls, inner: optax.GradientTransformation, plan: Plan, subgroup: Subgroup, shared_paths: Sequence[str]
    ) -> SubgroupSpec:
        pieces = tuple(Piece(p.leaf, None if p.rows is None else (0, p.rows[1] - p.rows[0])) for p in subgroup.pieces)
        treedef = subgroup.layout.state_treedef
        return cls(
            inner,
            plan.treedef,
            len(plan.leaves),
            pieces,
            tuple(update_dtype(plan, p.leaf) for p in pieces),
            treedef,
            plan.master_dtype,
            _positions(treedef, shared_paths),
            remainders.held_as_remainders(subgroup.layout.master_fields) or (False,) * len(pieces),
        )

    def view(self, values: Sequence[Any]) -> Any:
        return partition.view_of(self.treedef, self.num_leaves, self.pieces, values)


class Executables:
    """Compiled subgroup programs, shared by every subgroup whose lowered program is the same.

    The views of identical blocks lower to the same program (the positions of their ``None``
    leaves leave no trace in it), so a model of 24 identical blocks compiles once, not 24 times.
    Lowering is cheap; XLA compilation is what this saves. Both maps are bounded LRUs.
    """

    def __init__(self, capacity: int = 1024):
        self._capacity = capacity
        self._by_signature: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self._by_program: collections.OrderedDict[Any, Any] = collections.OrderedDict()

    def _remember(self, table: collections.OrderedDict, key: Any, value: Any) -> None:
        table[key] = value
        table.move_to_end(key)
        if len(table) > self._capacity:
            table.popitem(last=False)

    def __call__(self, function: Any, spec: SubgroupSpec, *args: Any) -> Any:
        """Runs ``function(spec, *args)`` through a shared executable."""
        leaves, structure = jax.tree_util.tree_flatten(args)
        # An executable runs only on the device it was compiled for.
        signature = (spec, structure, leaves[0].sharding, tuple((x.shape, x.dtype) for x in leaves))
        executable = self._by_signature.get(signature)
        if executable is None:
            lowered = function.lower(spec, *args)
            # The text leaves out arguments the program never reads, so the shapes join the key.
            program = (hashlib.sha256(lowered.as_text().encode()).hexdigest(), signature[1:])
            executable = self._by_program.get(program) or lowered.compile()
            self._remember(self._by_program, program, executable)
            self._remember(self._by_signature, signature, executable)
        return executable(*args)


EXECUTABLES = Executables()


def empty_view(plan: Plan) -> Any:
    """The params tree with ``None`` for every leaf: the view of no subgroup, whose state is the shared state."""
    return jax.tree_util.tree_unflatten(plan.treedef, [None] * len(plan.leaves))


def _positions(state_treedef: Any, shared_paths: Sequence[str]) -> tuple[int, ...]:
    """Where each shared state leaf is among a subgroup's state leaves (found by tree path)."""
    paths = partition.treedef_paths(state_treedef)
    missing = [path for path in shared_paths if path not in paths]
    if missing:
        raise OffloadError(
            f"the inner optimizer's state {missing[0]} is in the state of a view with no leaves but not in every "
            "subgroup's, so it is not held alike by all subgroups; use a leaf-wise optimizer"
        )
    return tuple(paths.index(path) for path in shared_paths)


class Uniform(NamedTuple):
    """What every subgroup of one update is given alike.

    Attributes:
      shared: the shared state leaves the update starts from, in place of each record's copy.
      new_shared: their new values, written into every subgroup's new state.
      extra_args: the extra keyword arguments of ``inner.update`` (arrays).
    """

    shared: tuple[jax.Array, ...]
    new_shared: tuple[jax.Array, ...]
    extra_args: dict[str, jax.Array]

    def to(self, device: jax.Device | None) -> Uniform:
        """The same values on ``device`` (None: left where they are)."""
        return self if device is None else jax.device_put(self, device)


def _slice_rows(leaf: jax.Array, start: jax.Array, piece: Piece) -> jax.Array:
    if piece.rows is None:
        return leaf
    return jax.lax.dynamic_slice_in_dim(leaf, start, piece.rows[1], axis=0)


@functools.partial(jax.jit, static_argnums=0)
def _subgroup_init(spec: SubgroupSpec, params: Sequence[jax.Array], starts: Sequence[jax.Array]) -> tuple:
    """The inner optimizer's initial state (and master params) for one subgroup."""
    pieces = [_slice_rows(x, s, p) for x, s, p in zip(params, starts, spec.pieces, strict=True)]
    if spec.master_dtype is None:
        return jax.tree_util.tree_leaves(spec.inner.init(spec.view(pieces))), []
    masters = [x.astype(spec.master_dtype) for x in pieces]
    state = spec.inner.init(spec.view(masters))
    return jax.tree_util.tree_leaves(state), [_stored(m, r) for m, r in zip(masters, spec.remainders, strict=True)]


def _stored(master: jax.Array, remainder: bool) -> jax.Array:
    """A master as its record holds it: whole, or its int16 remainder."""
    return remainders.split(master)[1] if remainder else master


def _masters(spec: SubgroupSpec, params: Sequence[jax.Array], stored: Sequence[jax.Array]) -> list[jax.Array]:
    """The masters, from the record's fields and, for remainders, the params on the device (their high half)."""
    return [remainders.rebuild(p, m) if r else m for p, m, r in zip(params, stored, spec.remainders, strict=True)]


def _new_params(spec: SubgroupSpec, masters: Sequence[jax.Array], params: Sequence[jax.Array]) -> list[jax.Array]:
    """The params the new masters give: the high half of a remainder's split, else the master's cast."""
    return [
        remainders.split(m)[0] if r else m.astype(p.dtype)
        for m, p, r in zip(masters, params, spec.remainders, strict=True)
    ]


class SubgroupArgs(NamedTuple):
    """The arguments every subgroup program (update or apply) takes besides its spec and donated buffers.

    Attributes:
      grads: each piece's gradient block.
      starts: each piece's first row (0 for a whole piece), on the subgroup's device.
      state_leaves: the subgroup's inner state leaves, on the device.
      master_leaves: its master param leaves as stored (whole, or int16 remainders; empty without a master).
      uniform: the shared state and extra arguments, on the device.
    """

    grads: Sequence[jax.Array]
    starts: Sequence[jax.Array]
    state_leaves: Sequence[jax.Array]
    master_leaves: Sequence[jax.Array]
    uniform: Uniform

    @classmethod
    def of(
        cls, subgroup: Subgroup, device: jax.Device | None, grads: Sequence[jax.Array], fields: tuple, uniform: Uniform
    ) -> SubgroupArgs:
        """The arguments of ``subgroup``'s program on ``device``, from its (state leaves, master leaves) ``fields``."""
        state_leaves, master_leaves = fields
        return cls(list(grads), _row_starts(subgroup, device), state_leaves, master_leaves, uniform.to(device))


def _inner_step(spec: SubgroupSpec, params: Sequence[jax.Array] | None, args: SubgroupArgs) -> tuple:
    """One subgroup's inner update on its view, the body of both the update and the apply program.

    Gradients are up-cast here to the dtype the optimizer works in (the master dtype, or the
    param dtype). ``params`` may be None (no master) when the inner optimizer needs none. The
    shared state leaves come from ``args.uniform`` in and go out as ``uniform.new_shared``.

    With remainders, the master is rebuilt from the params the user holds, so it follows params
    changed between steps (see :mod:`jax_mlp._src.plan.remainders`).

    Returns:
      Per piece, its update in :func:`update_dtype`; the new state leaves; the new master leaves as
      stored; the new params (with a master; else None), which ``p + update`` lands on.
    """
    pieces = spec.pieces
    grad_pieces = [
        _slice_rows(g, s, p).astype(d) for g, s, p, d in zip(args.grads, args.starts, pieces, spec.dtypes, strict=True)
    ]
    param_pieces = (
        None if params is None else [_slice_rows(x, s, p) for x, s, p in zip(params, args.starts, pieces, strict=True)]
    )
    if spec.master_dtype is not None:
        masters = _masters(spec, param_pieces, args.master_leaves)
        inner_params = spec.view(masters)
    else:
        inner_params = None if param_pieces is None else spec.view(param_pieces)
    uniform = args.uniform
    state = jax.tree_util.tree_unflatten(spec.state_treedef, _placed(args.state_leaves, spec.shared, uniform.shared))
    updates, new_state = spec.inner.update(spec.view(grad_pieces), state, inner_params, **uniform.extra_args)
    update_pieces = jax.tree_util.tree_leaves(updates)
    if spec.master_dtype is not None:
        new_master = [optax.apply_updates(m, u) for m, u in zip(masters, update_pieces, strict=True)]
        new_params = _new_params(spec, new_master, param_pieces)
        user_updates = [
            remainders.landing_update(p, n, spec.master_dtype) for p, n in zip(param_pieces, new_params, strict=True)
        ]
        stored = [_stored(m, r) for m, r in zip(new_master, spec.remainders, strict=True)]
    else:
        new_params, stored = None, []
        user_updates = [u.astype(d) for u, d in zip(update_pieces, spec.dtypes, strict=True)]
    new_state_leaves = _placed(jax.tree_util.tree_leaves(new_state), spec.shared, uniform.new_shared)
    return user_updates, new_state_leaves, stored, new_params


def _written(spec: SubgroupSpec, blocks: Sequence[Any], starts: Sequence[jax.Array], values: Sequence) -> list:
    """Per piece, its new value as the whole block, or written in place into its leaf's block at its rows."""
    return [
        new if piece.rows is None else jax.lax.dynamic_update_slice_in_dim(block, new, start, axis=0)
        for piece, start, new, block in zip(spec.pieces, starts, values, blocks, strict=True)
    ]


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _subgroup_update(
    spec: SubgroupSpec,
    accumulators: Sequence[jax.Array | None],
    params: Sequence[jax.Array] | None,
    args: SubgroupArgs,
) -> tuple:
    """One subgroup's update: the updates of a row chunk are written into its leaf's accumulator in place.

    Returns:
      Per piece, its update (or its updated accumulator); the new state leaves; the new master leaves.
    """
    user_updates, new_state, new_master, _ = _inner_step(spec, params, args)
    return _written(spec, accumulators, args.starts, user_updates), new_state, new_master


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _subgroup_apply(spec: SubgroupSpec, params: Sequence[jax.Array], args: SubgroupArgs) -> tuple:
    """One subgroup's update applied to its params, which are donated: the new values take their buffers.

    A whole piece's new block replaces its param block; a row chunk's rows are written into its
    leaf's block in place. With a master, the new params are the new master's bf16 word (what
    ``update`` plus ``optax.apply_updates`` gives, see :func:`remainders.landing_update`); without, ``p + u``.

    Returns:
      Per piece, its new param block (for a row chunk, its leaf's whole block); the new state
      leaves; the new master leaves.
    """
    user_updates, new_state, new_master, new_params = _inner_step(spec, params, args)
    if new_params is not None:
        new_pieces = new_params
    else:
        new_pieces = [
            optax.apply_updates(_slice_rows(x, s, p), u)
            for x, s, p, u in zip(params, args.starts, spec.pieces, user_updates, strict=True)
        ]
    return _written(spec, params, args.starts, new_pieces), new_state, new_master


def _placed(leaves: Sequence[jax.Array], positions: Sequence[int], values: Sequence[jax.Array]) -> list[jax.Array]:
    """``leaves`` with ``values`` at ``positions``."""
    placed = list(leaves)
    for position, value in zip(positions, values, strict=True):
        placed[position] = value
    return placed


@functools.partial(jax.jit, static_argnums=(0, 1))
def _shared_update(
    inner: optax.GradientTransformationExtraArgs, treedef: Any, shared: Any, extra_args: dict[str, jax.Array]
) -> Any:
    """The inner update on a view with no leaves: the shared state's next value."""
    empty = jax.tree_util.tree_unflatten(treedef, [None] * treedef.num_leaves)
    return inner.update(empty, shared, empty, **extra_args)[1]


def _row_starts(subgroup: Subgroup, device: jax.Device | None) -> list[jax.Array]:
    return [jax.device_put(np.int32(0 if p.rows is None else p.rows[0]), device) for p in subgroup.pieces]


class SubgroupUpdate(NamedTuple):
    """What one subgroup's update (or apply) program returns: per piece its update block (or new
    param block; for a row chunk, its leaf's updated accumulator or param block), then the new state
    leaves and master leaves; and, for a layer-streamed step, each piece's new params for its params record."""

    outputs: list[jax.Array]
    state_leaves: list[jax.Array]
    master_leaves: list[jax.Array]
    param_pieces: list[jax.Array] | None = None


class Programs:
    """The subgroup programs of one plan: a spec per subgroup, run through the shared executables.

    Made with the plan and dropped with it, so a retried ``init`` never sees another plan's specs.

    Args:
      inner: the optimizer whose init and update run per subgroup (taking extra arguments).
      plan: the subgroups.

    Attributes:
      shared_shapes: the shared state (``inner.init`` of a view with no leaves), as shapes.
    """

    def __init__(self, inner: optax.GradientTransformationExtraArgs, plan: Plan):
        self._inner = inner
        self._treedef = plan.treedef
        self.shared_shapes = partition.init_shapes(inner, empty_view(plan))
        paths = partition.paths_of(self.shared_shapes)
        self._specs = [SubgroupSpec.of(inner, plan, subgroup, paths) for subgroup in plan.subgroups]

    def shared_of(self, subgroup: Subgroup, state_leaves: Sequence[Any]) -> list[Any]:
        """The shared state leaves among a subgroup's state leaves."""
        return [state_leaves[i] for i in self._specs[subgroup.index].shared]

    def shared_update(self, shared: Any, extra_args: dict[str, jax.Array]) -> Any:
        """The shared state after one update from ``shared`` (traceable: the in-jit route traces it)."""
        return _shared_update(self._inner, self._treedef, shared, extra_args)

    def init(self, subgroup: Subgroup, params: Sequence[jax.Array], device: jax.Device | None) -> tuple:
        """The subgroup's initial (state leaves, master leaves), from its pieces' param blocks."""
        return EXECUTABLES(_subgroup_init, self._specs[subgroup.index], list(params), _row_starts(subgroup, device))

    def update(
        self,
        subgroup: Subgroup,
        args: SubgroupArgs,
        params: Sequence[jax.Array] | None,
        accumulators: Sequence[jax.Array | None],
    ) -> SubgroupUpdate:
        """One subgroup's update, on the device its ``args`` are on.

        Args:
          subgroup: the subgroup.
          args: its grad blocks, row starts, fields and uniform values (:meth:`SubgroupArgs.of`).
          params: each piece's param block, or None when the update needs no params.
          accumulators: per piece, its leaf's accumulator for a row chunk (donated), else None.

        Returns:
          The update blocks and the new state and master leaves.
        """
        return SubgroupUpdate(
            *EXECUTABLES(_subgroup_update, self._specs[subgroup.index], list(accumulators), params, args)
        )

    def apply(self, subgroup: Subgroup, args: SubgroupArgs, params: Sequence[jax.Array]) -> SubgroupUpdate:
        """One subgroup's update applied to its param blocks, which are donated.

        Args: as :meth:`update`, with ``params`` each piece's param block (for a row chunk, its leaf's
        whole block, into which its rows are written) and no accumulators.

        Returns:
          The new param blocks and the new state and master leaves.
        """
        return SubgroupUpdate(*EXECUTABLES(_subgroup_apply, self._specs[subgroup.index], list(params), args))
