"""Device programs: the jitted init and update of one subgroup, and the executable cache they share.

A subgroup's program sees the user's whole tree with ``None`` outside the subgroup (its *view*), so
masks and per-leaf optimizers keep their meaning. Programs are keyed by a :class:`SubgroupSpec`
and shared through :class:`Executables`: a model of 24 identical blocks compiles once.
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

from jax_mlp import partition
from jax_mlp.partition import Piece, Plan, Subgroup


def update_dtype(plan: Plan, leaf: int) -> np.dtype:
    """The dtype a leaf's optimizer works in, and its updates come in: the master dtype, else the param's."""
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

    @classmethod
    def of(cls, inner: optax.GradientTransformation, plan: Plan, subgroup: Subgroup) -> SubgroupSpec:
        pieces = tuple(Piece(p.leaf, None if p.rows is None else (0, p.rows[1] - p.rows[0])) for p in subgroup.pieces)
        dtypes = tuple(update_dtype(plan, p.leaf) for p in pieces)
        return cls(
            inner, plan.treedef, len(plan.leaves), pieces, dtypes, subgroup.layout.state_treedef, plan.master_dtype
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


def _slice_rows(leaf: jax.Array, start: jax.Array, piece: Piece) -> jax.Array:
    if piece.rows is None:
        return leaf
    return jax.lax.dynamic_slice_in_dim(leaf, start, piece.rows[1], axis=0)


@functools.partial(jax.jit, static_argnums=0)
def _subgroup_init(spec: SubgroupSpec, params: Sequence[jax.Array], starts: Sequence[jax.Array]) -> tuple:
    """The inner optimizer's initial state (and master params) for one subgroup."""
    pieces = [_slice_rows(x, s, p) for x, s, p in zip(params, starts, spec.pieces, strict=True)]
    if spec.master_dtype is not None:
        pieces = [x.astype(spec.master_dtype) for x in pieces]
    state = spec.inner.init(spec.view(pieces))
    return jax.tree_util.tree_leaves(state), pieces if spec.master_dtype is not None else []


@functools.partial(jax.jit, static_argnums=0, donate_argnums=6)
def _subgroup_update(
    spec: SubgroupSpec,
    grads: Sequence[jax.Array],
    params: Sequence[jax.Array] | None,
    starts: Sequence[jax.Array],
    state_leaves: Sequence[jax.Array],
    master_leaves: Sequence[jax.Array],
    accumulators: Sequence[jax.Array | None],
) -> tuple:
    """One subgroup's inner update on its view.

    Gradients are up-cast here to the dtype the optimizer works in (the master dtype, or the
    param dtype). ``params`` may be None (no master) when the inner optimizer needs none. Updates
    of a row chunk are written into its leaf's accumulator in place.

    Returns:
      Per piece, its update (or its updated accumulator); the new state leaves; the new master leaves.
    """
    grad_pieces = [
        _slice_rows(g, s, p).astype(d) for g, s, p, d in zip(grads, starts, spec.pieces, spec.dtypes, strict=True)
    ]
    param_pieces = (
        None if params is None else [_slice_rows(x, s, p) for x, s, p in zip(params, starts, spec.pieces, strict=True)]
    )
    if spec.master_dtype is not None:
        inner_params = spec.view(master_leaves)
    else:
        inner_params = None if param_pieces is None else spec.view(param_pieces)
    state = jax.tree_util.tree_unflatten(spec.state_treedef, state_leaves)
    updates, new_state = spec.inner.update(spec.view(grad_pieces), state, inner_params)
    update_pieces = jax.tree_util.tree_leaves(updates)
    if spec.master_dtype is not None:
        new_master = [optax.apply_updates(m, u) for m, u in zip(master_leaves, update_pieces, strict=True)]
        # In fp32, p + (m_lowp - p) == m_lowp: apply_updates then yields exactly the master's cast.
        user_updates = [
            m.astype(p.dtype).astype(m.dtype) - p.astype(m.dtype) for m, p in zip(new_master, param_pieces, strict=True)
        ]
    else:
        new_master = []
        user_updates = [u.astype(d) for u, d in zip(update_pieces, spec.dtypes, strict=True)]
    outputs = [
        u if piece.rows is None else jax.lax.dynamic_update_slice_in_dim(acc, u, start, axis=0)
        for piece, start, u, acc in zip(spec.pieces, starts, user_updates, accumulators, strict=True)
    ]
    return outputs, jax.tree_util.tree_leaves(new_state), new_master


def _row_starts(subgroup: Subgroup, device: jax.Device | None) -> list[jax.Array]:
    return [jax.device_put(np.int32(0 if p.rows is None else p.rows[0]), device) for p in subgroup.pieces]


class SubgroupUpdate(NamedTuple):
    """What one subgroup's update program returns: per piece its update block (or the updated
    accumulator of a row chunk's leaf), then the new state leaves and master leaves."""

    outputs: list[jax.Array]
    state_leaves: list[jax.Array]
    master_leaves: list[jax.Array]


class Programs:
    """The subgroup programs of one plan: a spec per subgroup, run through the shared executables.

    Made with the plan and dropped with it, so a retried ``init`` never sees another plan's specs.

    Args:
      inner: the optimizer whose init and update run per subgroup.
      plan: the subgroups.
    """

    def __init__(self, inner: optax.GradientTransformation, plan: Plan):
        self._specs = [SubgroupSpec.of(inner, plan, subgroup) for subgroup in plan.subgroups]

    def init(self, subgroup: Subgroup, params: Sequence[jax.Array], device: jax.Device | None) -> tuple:
        """The subgroup's initial (state leaves, master leaves), from its pieces' param blocks."""
        return EXECUTABLES(_subgroup_init, self._specs[subgroup.index], list(params), _row_starts(subgroup, device))

    def update(
        self,
        subgroup: Subgroup,
        device: jax.Device | None,
        grads: Sequence[jax.Array],
        params: Sequence[jax.Array] | None,
        fields: tuple,
        accumulators: Sequence[jax.Array | None],
    ) -> SubgroupUpdate:
        """One subgroup's update on ``device``.

        Args:
          subgroup: the subgroup.
          device: where it runs (None: the default device).
          grads: each piece's gradient block.
          params: each piece's param block, or None when the update needs no params.
          fields: the subgroup's (state leaves, master leaves) on the device.
          accumulators: per piece, its leaf's accumulator for a row chunk (donated), else None.

        Returns:
          The update blocks and the new state and master leaves.
        """
        state_leaves, master_leaves = fields
        starts = _row_starts(subgroup, device)
        args = (list(grads), params, starts, state_leaves, master_leaves, list(accumulators))
        return SubgroupUpdate(*EXECUTABLES(_subgroup_update, self._specs[subgroup.index], *args))
