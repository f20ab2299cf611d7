"""One initialised offload run: what ``update`` and ``apply`` stream with, and how each call is routed.

A :class:`Run` is made by ``Offloader.init`` once the tiers hold the state. Each call is checked
once (:mod:`jax_mlp.calls`), then routed by what it is: traced inside ``jax.jit`` (the in-jit
route), one call of an accumulation window, or an eager update; ``apply`` is the eager update with
the :data:`~jax_mlp.step.LATE_PUT` route and :class:`~jax_mlp.blocks.NewParams` as its results.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jax_mlp import accumulation, inputs
from jax_mlp.blocks import Blocks, NewParams
from jax_mlp.calls import Call, CallChecks
from jax_mlp.config import OffloadConfig
from jax_mlp.errors import OffloadError
from jax_mlp.in_jit import JitRoute
from jax_mlp.partition import Plan
from jax_mlp.programs import update_dtype
from jax_mlp.sharding import LeafSharding
from jax_mlp.state import OffloadState
from jax_mlp.step import EAGER, LATE_PUT, StateStream


class Run(NamedTuple):
    """What an initialised offloader runs with.

    Attributes:
      config: the offload's options.
      plan: the subgroups.
      sharding: each leaf's sharding and owned shards, as at ``init``.
      stream: the offloaded state and the transactions that update it.
      jit: the in-jit route.
      calls: the checks of each call.
    """

    config: OffloadConfig
    plan: Plan
    sharding: LeafSharding
    stream: StateStream
    jit: JitRoute
    calls: CallChecks

    def update(self, updates: Any, state: OffloadState, params: Any, extra_args: dict) -> tuple[Any, OffloadState]:
        """``Offloader.update``: the updates, in the grads' tree as given, and the new handle."""
        call = self.calls.check("update", updates, state, params, extra_args)
        if call.traced:
            leaves, state = self._update_in_jit(call, state)
        elif self.config.accumulate_steps > 1:
            leaves, state = self._accumulate(call, state)
        else:
            leaves, step, shared = self._stream(call, call.grads, state.step)
            state = OffloadState(step, shared)
        return jax.tree_util.tree_unflatten(call.grads_tree, leaves), state

    def _update_in_jit(self, call: Call, state: OffloadState) -> tuple[list, OffloadState]:
        """Traces the update as the in-jit route's host callbacks (see :mod:`jax_mlp.in_jit`).

        Accumulation is refused here: its choice would be a ``lax.cond`` around the host callback,
        and that was seen to deadlock XLA's CPU runtime now and then (the callback's device work
        waiting behind the caller's next step), so it is refused rather than left to hang.
        """
        accumulation.refuse_multisteps()
        if self.config.accumulate_steps > 1:
            raise OffloadError(
                f"mlp_offload with accumulate_steps={self.config.accumulate_steps} was called inside jax.jit; "
                "accumulation runs eagerly: call tx.update (or nnx.Optimizer.update) outside jit, with the jitted "
                "loss and gradients before it, or accumulate in your jitted step and create the mlp_offload "
                "without accumulate_steps"
            )
        uniform, new_shared = self.calls.uniform(call)
        return self.jit.trace(call.grads, call.params, state.step, uniform), OffloadState(state.step + 1, new_shared)

    def _accumulate(self, call: Call, state: OffloadState) -> tuple[list, OffloadState]:
        """One eager call of an accumulation window: folds the grads in; the window's last call streams their mean.

        The shared state moves on only with the update, as the inner state does in ``optax.MultiSteps``.
        """
        config, plan = self.config, self.plan
        window = accumulation.Window(state.mini_step, jax.tree_util.tree_leaves(state.acc_grads))
        means, carried = accumulation.add(call.grads, window, config.accumulator_dtype)
        if int(window.mini_step) < config.accumulate_steps - 1:
            self.stream.check_step(int(state.step))
            self.stream.use_idle_window()
            dtypes = tuple(update_dtype(plan, i) for i in range(len(plan.leaves)))
            leaves, step, shared, window = (
                accumulation.zero_updates(call.grads, dtypes),
                state.step,
                call.shared,
                carried,
            )
        else:
            leaves, step, shared = self._stream(call, means, state.step)
            window = accumulation.empty_window(carried.acc_grads, config.accumulator_dtype)
        acc_grads = jax.tree_util.tree_unflatten(inputs.bare_treedef(plan.treedef), window.acc_grads)
        return leaves, OffloadState(step, shared, window.mini_step, acc_grads)

    def _stream(self, call: Call, grads: list, step: jax.Array) -> tuple[list, jax.Array, Any]:
        """One eager update from ``step`` with ``grads``: the update leaves, the new step and the new shared state."""
        uniform, new_shared = self.calls.uniform(call)
        blocks = Blocks.of(self.plan, self.sharding, grads, call.params, uniform)
        results = self.stream.run_step(int(step), blocks, EAGER)
        return self.sharding.assemble(self.plan, results), jnp.asarray(self.stream.step, jnp.int32), new_shared

    def apply(self, grads: Any, state: OffloadState, params: Any, extra_args: dict) -> tuple[Any, OffloadState]:
        """``Offloader.apply``: the new params, written over the donated old ones in their tree, and the new handle."""
        call = self.calls.check("apply", grads, state, params, extra_args)
        _refuse_to_apply(call, self.config.accumulate_steps)
        inputs.check_distinct(self.plan, call.grads, call.params)
        del grads, params
        uniform, new_shared = self.calls.uniform(call)
        blocks = Blocks.of(self.plan, self.sharding, call.grads, None, uniform)
        results = NewParams(self.plan, self.sharding.block_map(call.params), call.grads, blocks.grads)
        new_leaves = self.sharding.assemble(self.plan, self.stream.run_step(int(state.step), blocks, LATE_PUT, results))
        for leaf in call.params:  # the replicas an owner's new block was copied to
            leaf.delete()
        new_params = jax.tree_util.tree_unflatten(call.params_tree, new_leaves)
        return new_params, OffloadState(jnp.asarray(self.stream.step, jnp.int32), new_shared)


def _refuse_to_apply(call: Call, accumulate_steps: int) -> None:
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
