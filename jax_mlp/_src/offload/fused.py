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
from jax_mlp._src.offload.route import Call, Outcome, Parts
from jax_mlp._src.state import OffloadState
from jax_mlp._src.stream.blocks import Blocks, NewParams
from jax_mlp._src.stream.state_stream import LATE_PUT


class FusedRoute:
    """The fused ``apply`` of one offload.

    Args:
      parts: what the offload's routes are built from.
    """

    def __init__(self, parts: Parts):
        self._parts = parts

    def run(self, call: Call) -> Outcome:
        """The new params, written over the donated ones, and the new handle.

        Raises:
          OffloadError: no params, accumulation, a traced call, or an array given twice among params and grads.
        """
        parts = self._parts
        plan, sharding = parts.plan, parts.sharding
        _refuse(call, parts.config.accumulate_steps)
        inputs.check_distinct(plan, call.grads, call.params)
        uniform, new_shared = parts.calls.uniform(call)
        notes = parts.overlap.abandon("apply runs the update itself, from the params it donates")
        blocks = Blocks.of(plan, sharding, call.grads, None, uniform)
        results = NewParams(plan, sharding.block_map(call.params), call.grads, blocks.grads)
        updated = parts.stream.advance(int(call.state.step), blocks, LATE_PUT, results, notes)
        new_leaves = sharding.assemble(plan, updated)
        for leaf in call.params:  # the replicas an owner's new block was copied to
            leaf.delete()
        state = OffloadState(jnp.asarray(parts.stream.step, jnp.int32), new_shared)
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
