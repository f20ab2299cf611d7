"""One update's device blocks: what each subgroup's program is given, and what it gives back.

:class:`Blocks` is the input side, as data: every owned gradient (and param) block by
``(leaf, owner device id)``, the device each subgroup runs on, and the values every subgroup is
given alike. The output side keeps each program's results: :class:`UpdateBlocks` the updates (with
one in-place accumulator per row-split block), :class:`NewParams` the fused apply's new params.

Blocks in host memory (params and grads in ``pinned_host``) visit the device: :class:`Staging`
copies each to its device just before its program and each result back to its leaf's memory kind
once its block is done, so every program takes and gives device arrays only.
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
from jax_mlp._src.plan.sharding import DEVICE_MEMORY, BlockKey, LeafSharding, in_memory


class Staging:
    """One update's way through device memory for blocks in host memory: programs never touch host memory.

    A program that donated a host buffer into a device output aborts the process (SIGABRT, not an
    exception: see docs/architecture.md, "Params and grads in host memory"), and one that mixes host
    and device operands fails to compile; so every program takes device arrays only. A piece's host
    grad and param blocks are copied to its device just before its program (:meth:`on_device`), and
    each result goes back to its leaf's memory kind once its block has no piece left (:meth:`out`). A
    block cut into row chunks keeps its device copies, and its result, on the device from its first
    chunk to its last, so each of its bytes crosses the link once each way. Blocks already in device
    memory pass through untouched.

    Args:
      plan: the subgroups.
      kinds: each leaf's memory kind, as at ``init``.
    """

    def __init__(self, plan: Plan, kinds: Sequence[str]):
        self._kinds = tuple(kinds)
        self._left = collections.Counter((p.leaf, p.device) for subgroup in plan.subgroups for p in subgroup.pieces)
        self._copies: dict[tuple[str, BlockKey], jax.Array] = {}

    def on_device(self, name: str, key: BlockKey, block: jax.Array) -> jax.Array:
        """The ``name`` block (``"grads"`` or ``"params"``) of ``key`` in device memory, copied once per update."""
        if self._kinds[key[0]] == DEVICE_MEMORY:
            return block
        if (name, key) not in self._copies:
            self._copies[name, key] = in_memory(block, DEVICE_MEMORY)
        return self._copies[name, key]

    def done(self, subgroup: Subgroup) -> list[bool]:
        """Counts ``subgroup``'s pieces as run: per piece, whether it was its block's last (its copies are dropped).

        Call it once the subgroup's program is dispatched: the program holds its own references.
        """
        last = []
        for p in subgroup.pieces:
            key = (p.leaf, p.device)
            self._left[key] -= 1
            last.append(not self._left[key])
            if last[-1]:
                self._copies.pop(("grads", key), None)
                self._copies.pop(("params", key), None)
        return last

    def out(self, key: BlockKey, block: jax.Array) -> jax.Array:
        """A done block's result (a device array) in its leaf's memory kind."""
        return in_memory(block, self._kinds[key[0]])


class Blocks(NamedTuple):
    """Where one update's inputs are.

    Attributes:
      grads: each owned gradient block (the whole leaf, or its shard), by (leaf, owner device id).
      params: the same for params, or None when the update needs no params.
      devices: per subgroup index, the device its program runs on (None: the default device).
      uniform: what every subgroup is given alike (the shared state and the extra arguments).
      staging: the device copies of the blocks in host memory.
    """

    grads: Mapping[BlockKey, jax.Array]
    params: Mapping[BlockKey, jax.Array] | None
    devices: Sequence[jax.Device | None]
    uniform: Uniform
    staging: Staging

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
        devices = sharding.devices(plan, grads)
        return cls(sharding.block_map(grads), param_blocks, devices, uniform, Staging(plan, sharding.kinds))

    def args(self, subgroup: Subgroup, fields: tuple) -> SubgroupArgs:
        """The program arguments of ``subgroup`` with its fetched ``fields``, on its device."""
        keys = [(p.leaf, p.device) for p in subgroup.pieces]
        grads = [self.staging.on_device("grads", key, self.grads[key]) for key in keys]
        return SubgroupArgs.of(subgroup, self.devices[subgroup.index], grads, fields, self.uniform)

    def params_of(self, subgroup: Subgroup) -> list[jax.Array] | None:
        """``subgroup``'s param blocks on its device, one per piece, or None when the update has no params."""
        if self.params is None:
            return None
        return [
            self.staging.on_device("params", (p.leaf, p.device), self.params[p.leaf, p.device]) for p in subgroup.pieces
        ]


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
        """Runs a subgroup's update program and keeps its update blocks, in their leaves' memory kinds once done."""
        accumulators = self._accumulators_for(subgroup, blocks.devices[subgroup.index])
        out = programs.update(subgroup, blocks.args(subgroup, fields), blocks.params_of(subgroup), accumulators)
        for p, block, last in zip(subgroup.pieces, out.outputs, blocks.staging.done(subgroup), strict=True):
            key = (p.leaf, p.device)
            if last:
                self._accumulators.pop(key, None)
                self._blocks[key] = blocks.staging.out(key, block)
            else:
                self._accumulators[key] = block
        return out

    def result(self) -> dict[BlockKey, jax.Array]:
        """Every block's update, by (leaf, owner device id)."""
        return {**self._blocks, **self._accumulators}


class NewParams:
    """The param blocks of one fused apply, each replaced by its new value as subgroups produce it.

    Each program is given its pieces' current blocks (a row chunk: its leaf's whole block) and
    donates them, so a new block takes the old one's buffer and no block is ever held twice. Once a
    leaf's last piece has run, its gradient leaf and blocks are deleted: the caller may still hold
    the leaf, and a block may be a resharded copy of it. A param block in host memory is copied to
    the device and deleted (donation across memory kinds is not implemented), and its new block goes
    back to host memory once its last piece has run.

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
        params = [_consumed_to_device(self._blocks.pop(k)) for k in keys]
        out = programs.apply(subgroup, blocks.args(subgroup, fields), params)
        for key, block, last in zip(keys, out.outputs, blocks.staging.done(subgroup), strict=True):
            self._blocks[key] = blocks.staging.out(key, block) if last else block
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


def _consumed_to_device(block: jax.Array) -> jax.Array:
    """A param block the fused apply consumes, in device memory: a host block is copied there and deleted."""
    on_device = in_memory(block, DEVICE_MEMORY)
    if on_device is not block:
        block.delete()  # the copy holds the buffer until it has read it
    return on_device
