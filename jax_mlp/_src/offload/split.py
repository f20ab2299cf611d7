"""The split route: an eager ``update`` (the fast route), or the finish of one the backward started.

The call's grads (and params, when the update reads them) become the step's
:class:`~jax_mlp._src.stream.blocks.Blocks`. If the last backward started this step's update
(``offload/overlap.py``), it is finished with them: committed where every block it took matches,
undone otherwise. Else, or after an undo, the state stream runs the whole update as one transaction.
The updates come back with the params' sharding, and the outcome says what the next backward may
assume: an update from the new step with the new shared state.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jax_mlp._src.offload.overlap import Overlap
from jax_mlp._src.offload.route import Call, Calls, Outcome
from jax_mlp._src.plan.partition import Plan
from jax_mlp._src.plan.sharding import LeafSharding
from jax_mlp._src.state import OffloadState
from jax_mlp._src.stream.blocks import Blocks
from jax_mlp._src.stream.state_stream import EAGER, StateStream


class SplitRoute:
    """Eager updates of one offload, finishing the overlapped ones.

    Args:
      calls: the offload's call checks (for the uniform values).
      plan: the subgroups.
      sharding: each leaf's sharding and owned shards.
      stream: the offloaded state.
      overlap: the update the backward may have started.
      needs_params: whether the update reads the params (the inner optimizer does, or a master is kept).
    """

    def __init__(
        self,
        calls: Calls,
        plan: Plan,
        sharding: LeafSharding,
        stream: StateStream,
        overlap: Overlap,
        needs_params: bool,
    ):
        self._calls, self._plan, self._sharding, self._stream = calls, plan, sharding, stream
        self._overlap, self._needs_params = overlap, needs_params

    def run(self, call: Call) -> Outcome:
        """One eager update with the call's grads."""
        leaves, state = self.stream(call, call.grads)
        return Outcome(leaves, call.grads_tree, state, self._overlap.basis(call.grads, state.shared))

    def stream(self, call: Call, grads: list[Any]) -> tuple[list[Any], OffloadState]:
        """The update of ``call``'s step with ``grads`` (the call's, or a window's mean): the update leaves and the
        new handle (without a window)."""
        uniform, new_shared = self._calls.uniform(call)
        params = call.params if self._needs_params else None  # the programs read none, on either path
        blocks = Blocks.of(self._plan, self._sharding, grads, params, uniform)
        results, notes = self._overlap.finish(blocks)
        if results is None:
            results = self._stream.advance(int(call.state.step), blocks, EAGER, notes=notes)
        leaves = self._sharding.assemble(self._plan, results)
        return leaves, OffloadState(jnp.asarray(self._stream.step, jnp.int32), new_shared)
