"""The accumulation route: one call of a gradient-accumulation window (``accumulate_steps=k``).

Calls 1 to k-1 fold their grads into the window the handle carries (``offload/window.py``) and
return zero updates; they touch no storage, and give the idle-time reads more records to read ahead.
Call k streams the window's mean through the split route. The shared state moves on only with the
update, as the inner state does in ``optax.MultiSteps``. Only the backward of a window's last call
may start the update, so the outcome of call k-1 is the one that says what it may assume.
"""

from __future__ import annotations

import jax

from jax_mlp._src.offload import window as windows
from jax_mlp._src.offload.inputs import bare_treedef
from jax_mlp._src.offload.route import Call, Outcome, Parts
from jax_mlp._src.offload.split import SplitRoute
from jax_mlp._src.plan.programs import update_dtype
from jax_mlp._src.state import OffloadState


class AccumulationRoute:
    """The eager calls of one offload's accumulation windows.

    Args:
      parts: what the offload's routes are built from.
      split: the route a window's last call takes, with the mean.
    """

    def __init__(self, parts: Parts, split: SplitRoute):
        self._parts, self._split = parts, split

    def run(self, call: Call) -> Outcome:
        """Folds the call's grads in; the window's last call streams their mean."""
        parts, state = self._parts, call.state
        config, plan = parts.config, parts.plan
        window = windows.Window(state.mini_step, jax.tree_util.tree_leaves(state.acc_grads))
        means, carried = windows.add(call.grads, window, config.accumulator_dtype)
        expect = None
        if int(window.mini_step) < config.accumulate_steps - 1:
            parts.overlap.settle()
            parts.stream.check_step(int(state.step))
            parts.stream.use_idle_window()
            dtypes = tuple(update_dtype(plan, i) for i in range(len(plan.leaves)))
            leaves, step, shared = windows.zero_updates(call.grads, dtypes), state.step, call.shared
            if int(carried.mini_step) == config.accumulate_steps - 1:  # the next grads complete the window
                expect = parts.overlap.basis(call.grads, shared, carried)
            window = carried
        else:
            leaves, streamed = self._split.stream(call, means)
            step, shared = streamed.step, streamed.shared
            window = windows.empty_window(carried.acc_grads, config.accumulator_dtype)
        acc_grads = jax.tree_util.tree_unflatten(bare_treedef(plan.treedef), window.acc_grads)
        return Outcome(leaves, call.grads_tree, OffloadState(step, shared, window.mini_step, acc_grads), expect)
