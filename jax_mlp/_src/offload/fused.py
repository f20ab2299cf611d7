"""The fused route: ``apply``, the update written over the donated params, subgroup by subgroup.

The same transaction as an eager update, with the :data:`~jax_mlp._src.stream.state_stream.LATE_PUT`
moves (fetched fields reach the device only when their program runs) and
:class:`~jax_mlp._src.stream.blocks.NewParams` keeping each program's new param blocks; each
gradient leaf is freed after its last subgroup. An update the backward started is undone first: it
cannot have read the params ``apply`` donates. The next backward starts none, for the same reason.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_mlp._src.errors import OffloadError
from jax_mlp._src.offload import inputs
from jax_mlp._src.offload.overlap import Overlap
from jax_mlp._src.offload.route import Call, Calls, Outcome
from jax_mlp._src.plan.partition import Plan
from jax_mlp._src.plan.sharding import LeafSharding
from jax_mlp._src.state import OffloadState
from jax_mlp._src.stream.blocks import Blocks, NewParams
from jax_mlp._src.stream.state_stream import LATE_PUT, StateStream


class FusedRoute:
    """The fused ``apply`` of one offload.

    Args:
      calls: the offload's call checks (for the uniform values).
      plan: the subgroups.
      sharding: each leaf's sharding and owned shards.
      stream: the offloaded state.
      overlap: the update the backward may have started (undone here).
      accumulate_steps: the offload's window; ``apply`` refuses to accumulate.
    """

    def __init__(
        self,
        calls: Calls,
        plan: Plan,
        sharding: LeafSharding,
        stream: StateStream,
        overlap: Overlap,
        accumulate_steps: int,
    ):
        self._calls, self._plan, self._sharding, self._stream = calls, plan, sharding, stream
        self._overlap, self._accumulate_steps = overlap, accumulate_steps

    def run(self, call: Call) -> Outcome:
        """The new params, written over the donated ones, and the new handle.

        Raises:
          OffloadError: no params, accumulation, a traced call, or an array given twice among params and grads.
        """
        _refuse(call, self._accumulate_steps)
        inputs.check_distinct(self._plan, call.grads, call.params)
        uniform, new_shared = self._calls.uniform(call)
        notes = self._overlap.abandon("apply runs the update itself, from the params it donates")
        blocks = Blocks.of(self._plan, self._sharding, call.grads, None, uniform)
        results = NewParams(self._plan, self._sharding.block_map(call.params), call.grads, blocks.grads)
        updated = self._stream.advance(int(call.state.step), blocks, LATE_PUT, results, notes)
        new_leaves = self._sharding.assemble(self._plan, updated)
        for leaf in call.params:  # the replicas an owner's new block was copied to
            leaf.delete()
        state = OffloadState(jnp.asarray(self._stream.step, jnp.int32), new_shared)
        return Outcome(new_leaves, call.params_tree, state, None)


def _refuse(call: Call, accumulate_steps: int) -> None:
    """Refuses an ``apply`` without params, inside a transformation, or with accumulation."""
    if call.params is None:
        raise OffloadError("mlp_offload.apply needs the params: call tx.apply(grads, opt_state, params)")
    if accumulate_steps > 1:
        raise OffloadError(
            f"mlp_offload.apply does not accumulate gradients (accumulate_steps={accumulate_steps}); use updates, "
            "opt_state = tx.update(grads, opt_state, params) and optax.apply_updates, or average the "
            "micro-batches' gradients yourself and create the mlp_offload without accumulate_steps"
        )
    if call.traced:
        raise OffloadError(
            "mlp_offload.apply was called inside a jax transformation (jit, grad, ...); it runs eagerly. Inside "
            "jit use updates, opt_state = tx.update(grads, opt_state, params) and optax.apply_updates, donating "
            "the params to the jitted step"
        )
