"""One update's device blocks: what each subgroup's program is given, and what it gives back.

:class:`Blocks` is the input side, as data: every owned gradient (and param) block by
``(leaf, owner device id)``, the device each subgroup runs on, and the values every subgroup is
given alike. The output side keeps each program's results: :class:`UpdateBlocks` the updates (with
one in-place accumulator per row-split block), :class:`NewParams` the fused apply's new params.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_mlp._src.plan import partition
from jax_mlp._src.plan.partition import Plan, Subgroup
from jax_mlp._src.plan.programs import Programs, SubgroupArgs, SubgroupUpdate, Uniform, update_dtype
from jax_mlp._src.plan.sharding import BlockKey, LeafSharding


class Blocks(NamedTuple):
    """Where one update's inputs are.

    Attributes:
      grads: each owned gradient block (the whole leaf, or its shard), by (leaf, owner device id).
      params: the same for params, or None when the update needs no params.
      devices: per subgroup index, the device its program runs on (None: the default device).
      uniform: what every subgroup is given alike (the shared state and the extra arguments).
    """

    grads: Mapping[BlockKey, jax.Array]
    params: Mapping[BlockKey, jax.Array] | None
    devices: Sequence[jax.Device | None]
    uniform: Uniform

    @classmethod
    def of(
        cls,
        plan: Plan,
        sharding: LeafSharding,
        grads: Sequence[jax.Array],
        params: Sequence[jax.Array] | None,
        uniform: Uniform,
    ) -> Blocks:
        """The blocks of the user's leaves; subgroups of whole leaves run where the grads are (if committed)."""
        param_blocks = None if params is None else sharding.block_map(params)
        return cls(sharding.block_map(grads), param_blocks, sharding.devices(plan, grads), uniform)

    def args(self, subgroup: Subgroup, fields: tuple) -> SubgroupArgs:
        """The program arguments of ``subgroup`` with its fetched ``fields``, on its device."""
        grads = [self.grads[p.leaf, p.device] for p in subgroup.pieces]
        return SubgroupArgs.of(subgroup, self.devices[subgroup.index], grads, fields, self.uniform)


class UpdateBlocks:
    """The update blocks of one step, as subgroups produce them: whole pieces' blocks, and one
    accumulator per row-split block that its chunks' programs write into in place."""

    def __init__(self, plan: Plan):
        self._plan = plan
        self._blocks: dict[BlockKey, jax.Array] = {}
        self._accumulators: dict[BlockKey, jax.Array] = {}

    def _accumulators_for(self, subgroup: Subgroup, device: jax.Device | None) -> list[jax.Array | None]:
        """Per piece, its block's accumulator if it is a row chunk (made on first use), else None."""
        for p in subgroup.pieces:
            if p.rows is not None and (p.leaf, p.device) not in self._accumulators:
                shape = partition.piece_shape(self._plan.leaves[p.leaf], p._replace(rows=None))
                dtype = update_dtype(self._plan, p.leaf)
                self._accumulators[p.leaf, p.device] = jnp.zeros(shape, dtype, device=device)
        return [self._accumulators[p.leaf, p.device] if p.rows is not None else None for p in subgroup.pieces]

    def compute(self, programs: Programs, subgroup: Subgroup, blocks: Blocks, fields: tuple) -> SubgroupUpdate:
        """Runs a subgroup's update program and keeps its update blocks."""
        params = None if blocks.params is None else [blocks.params[p.leaf, p.device] for p in subgroup.pieces]
        accumulators = self._accumulators_for(subgroup, blocks.devices[subgroup.index])
        out = programs.update(subgroup, blocks.args(subgroup, fields), params, accumulators)
        for p, block in zip(subgroup.pieces, out.outputs, strict=True):
            (self._accumulators if p.rows is not None else self._blocks)[p.leaf, p.device] = block
        return out

    def result(self) -> dict[BlockKey, jax.Array]:
        """Every block's update, by (leaf, owner device id)."""
        return {**self._blocks, **self._accumulators}


class NewParams:
    """The param blocks of one fused apply, each replaced by its new value as subgroups produce it.

    Each program is given its pieces' current blocks (a row chunk: its leaf's whole block) and
    donates them, so a new block takes the old one's buffer and no block is ever held twice. Once a
    leaf's last piece has run, its gradient leaf and blocks are deleted: the caller may still hold
    the leaf, and a block may be a resharded copy of it.

    Args:
      plan: the subgroups.
      params: each param block, by (leaf, owner device id); the caller must not use them afterwards.
      grads: the gradient leaves.
      grad_blocks: their blocks, as in the step's :class:`Blocks`.
    """

    def __init__(
        self,
        plan: Plan,
        params: Mapping[BlockKey, jax.Array],
        grads: Sequence[jax.Array],
        grad_blocks: Mapping[BlockKey, jax.Array],
    ):
        self._blocks = dict(params)
        self._grads: list[list[jax.Array]] = [[leaf] for leaf in grads]
        for (leaf, _), block in grad_blocks.items():
            self._grads[leaf].append(block)
        self._uses = collections.Counter(p.leaf for subgroup in plan.subgroups for p in subgroup.pieces)

    def compute(self, programs: Programs, subgroup: Subgroup, blocks: Blocks, fields: tuple) -> SubgroupUpdate:
        """Runs a subgroup's apply program on its donated param blocks and keeps the new ones."""
        keys = [(p.leaf, p.device) for p in subgroup.pieces]
        params = [self._blocks.pop(k) for k in keys]
        out = programs.apply(subgroup, blocks.args(subgroup, fields), params)
        self._blocks.update(zip(keys, out.outputs, strict=True))
        for p in subgroup.pieces:
            self._uses[p.leaf] -= 1
            if not self._uses[p.leaf]:
                for array in self._grads[p.leaf]:
                    array.delete()
                self._grads[p.leaf] = []
        return out

    def result(self) -> dict[BlockKey, jax.Array]:
        """Every block's new params, by (leaf, owner device id)."""
        return self._blocks
