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

from jax_mlp._src.offload.route import Call, Outcome, Parts
from jax_mlp._src.state import OffloadState
from jax_mlp._src.stream.blocks import Blocks
from jax_mlp._src.stream.state_stream import EAGER


class SplitRoute:
    """Eager updates of one offload, finishing the overlapped ones.

    Args:
      parts: what the offload's routes are built from.
    """

    def __init__(self, parts: Parts):
        self._parts = parts

    def run(self, call: Call) -> Outcome:
        """One eager update with the call's grads."""
        leaves, state = self.stream(call, call.grads)
        return Outcome(leaves, call.grads_tree, state, self._parts.overlap.basis(call.grads, state.shared))

    def stream(self, call: Call, grads: list[Any]) -> tuple[list[Any], OffloadState]:
        """The update of ``call``'s step with ``grads`` (the call's, or a window's mean): the update leaves and the
        new handle (without a window)."""
        parts = self._parts
        uniform, new_shared = parts.calls.uniform(call)
        params = call.params if parts.needs_params else None  # the programs read none, on either path
        blocks = Blocks.of(parts.plan, parts.sharding, grads, params, uniform)
        results, notes = parts.overlap.finish(blocks)
        if results is None:
            results = parts.stream.advance(int(call.state.step), blocks, EAGER, notes=notes)
        leaves = parts.sharding.assemble(parts.plan, results)
        return leaves, OffloadState(jnp.asarray(parts.stream.step, jnp.int32), new_shared)
