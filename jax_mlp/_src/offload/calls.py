"""The calls of ``update`` and ``apply``: each checked once, then routed by what it is.

``update`` and ``apply`` share one prologue. It turns what the user passed into a :class:`Call`
(leaves checked against the plan, the handle's shared state as a tree, extra arguments as arrays;
a new combination of extra-argument shapes is run through the optimizer check once) and gives
every subgroup's uniform values. Each call then takes its route: traced inside ``jax.jit`` (the
in-jit route), one call of an accumulation window, or an eager update; ``apply`` is the eager
update with the :data:`~jax_mlp._src.stream.state_stream.LATE_PUT` route and
:class:`~jax_mlp._src.stream.blocks.NewParams` as its results.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jax_mlp._src.config import OffloadConfig
from jax_mlp._src.errors import OffloadError
from jax_mlp._src.offload import accumulation, inputs
from jax_mlp._src.offload.in_jit import JitRoute
from jax_mlp._src.offload.overlap import Overlap
from jax_mlp._src.plan import optimizer_check
from jax_mlp._src.plan.partition import Plan
from jax_mlp._src.plan.programs import Uniform, update_dtype
from jax_mlp._src.plan.sharding import LeafSharding
from jax_mlp._src.state import OffloadState
from jax_mlp._src.stream.blocks import Blocks, NewParams
from jax_mlp._src.stream.state_stream import EAGER, LATE_PUT, StateStream


class Call(NamedTuple):
    """A checked call of ``update`` or ``apply``.

    Attributes:
      grads: the gradient leaves.
      params: the param leaves, or None when not given.
      shared: the handle's shared state, as a tree.
      extra: the extra arguments of ``inner.update``, as arrays.
      traced: whether the call is being traced (inside ``jax.jit``).
      grads_tree: the structure of the grads as given: the updates come back in it, as optax's do.
      params_tree: the structure of the params as given (``apply``'s new params come back in it), or None.
    """

    grads: list[jax.Array]
    params: list[jax.Array] | None
    shared: Any
    extra: dict[str, jax.Array]
    traced: bool
    grads_tree: Any
    params_tree: Any


@dataclasses.dataclass
class Calls:
    """The calls of one initialised offload: each ``update`` or ``apply`` checked once, then routed by what it is.

    The checks turn what the user passed into a :class:`Call` (the handle, the trees against the plan,
    the shared state, extra arguments checked once per signature). The route follows: traced inside
    ``jax.jit`` (the in-jit route), one call of an accumulation window, or an eager update; ``apply``
    is the eager update with the :data:`~jax_mlp._src.stream.state_stream.LATE_PUT` route and
    :class:`~jax_mlp._src.stream.blocks.NewParams` as its results.

    Attributes:
      inner: the inner optimizer (taking extra arguments).
      config: the offload's options.
      plan: the subgroups.
      sharding: each leaf's sharding and owned shards, as at ``init``.
      stream: the offloaded state and the transactions that update it.
      jit: the in-jit route.
      overlap_route: the update started in the backward pass (``offload.overlap``), which ``update`` finishes.
    """

    inner: optax.GradientTransformationExtraArgs
    config: OffloadConfig
    plan: Plan
    sharding: LeafSharding
    stream: StateStream
    jit: JitRoute
    overlap_route: Overlap

    def __post_init__(self) -> None:
        self._checked_extra_args = {self.config.extra_args}  # the signatures the optimizer check passed
        self._shared_treedef = jax.tree_util.tree_structure(self.stream.programs.shared_shapes)

    def check(self, verb: str, grads: Any, state: Any, params: Any, extra_args: dict[str, Any]) -> Call:
        """Checks a call of ``verb`` (``"update"`` or ``"apply"``) and returns it as a :class:`Call`.

        Raises:
          OffloadError: the handle is not this offloader's, a tree, shape, dtype or memory kind differs
            from the plan, or the extra arguments are not arrays; ``CoupledOptimizerError`` for extra
            arguments that couple leaves.
        """
        self._check_handle(verb, state)
        grad_leaves, param_leaves = inputs.check_update_inputs(self.plan, grads, params)
        inputs.check_memory_kinds(self.plan, self.sharding.kinds, grad_leaves, param_leaves)
        extra = self._checked_extra(extra_args)
        shared = jax.tree_util.tree_unflatten(
            self._shared_treedef, inputs.check_shared(self.stream.programs.shared_shapes, state.shared)
        )
        traced = inputs.is_traced((grad_leaves, state, param_leaves, extra))
        params_tree = None if params is None else jax.tree_util.tree_structure(params)
        return Call(grad_leaves, param_leaves, shared, extra, traced, jax.tree_util.tree_structure(grads), params_tree)

    def uniform(self, call: Call) -> tuple[Uniform, Any]:
        """What every subgroup is given alike (the shared state, its successor, the extra args), and that successor."""
        new_shared = self.stream.programs.shared_update(call.shared, call.extra)
        leaves = jax.tree_util.tree_leaves
        return Uniform(tuple(leaves(call.shared)), tuple(leaves(new_shared)), call.extra), new_shared

    def shared_of(self, leaves: list[Any]) -> Any:
        """The shared state leaves as the handle's tree."""
        return jax.tree_util.tree_unflatten(self._shared_treedef, leaves)

    def _check_handle(self, verb: str, state: Any) -> None:
        if not isinstance(state, OffloadState):
            raise OffloadError(
                f"mlp_offload.{verb} expects the OffloadState returned by its init, got {type(state).__name__}: "
                "pass the opt_state that init (or the previous update) returned"
            )
        accumulating = self.config.accumulate_steps > 1
        if accumulating != (state.mini_step is not None and state.acc_grads is not None):
            have = "has no accumulation window" if accumulating else "carries an accumulation window"
            raise OffloadError(
                f"this mlp_offload has accumulate_steps={self.config.accumulate_steps}, but the opt_state passed to "
                f"{verb} {have}: pass the OffloadState that this mlp_offload's init (or restore) returned"
            )

    def _checked_extra(self, extra_args: dict[str, Any]) -> dict[str, jax.Array]:
        """The extra arguments as arrays; the optimizer is checked with each new combination of their shapes."""
        extra = inputs.extra_arrays(extra_args)
        signature = tuple(sorted((k, jax.ShapeDtypeStruct(v.shape, v.dtype)) for k, v in extra.items()))
        if signature not in self._checked_extra_args:
            optimizer_check.check_extra_args(self.inner, self.plan, extra)
            self._checked_extra_args.add(signature)
        return extra

    def update(self, updates: Any, state: OffloadState, params: Any, extra_args: dict) -> tuple[Any, OffloadState]:
        """``Offloader.update``: the updates, in the grads' tree as given, and the new handle."""
        call = self.check("update", updates, state, params, extra_args)
        if call.traced:
            leaves, state = self._update_in_jit(call, state)
        elif self.config.accumulate_steps > 1:
            leaves, state = self._accumulate(call, state)
        else:
            leaves, step, shared = self._stream(call, call.grads, state.step)
            state = OffloadState(step, shared)
            self.expect_overlap(call.grads, shared)
        return jax.tree_util.tree_unflatten(call.grads_tree, leaves), state

    def first_handle(self, params: Sequence[Any]) -> OffloadState:
        """The handle at the step the tiers were filled at (an empty accumulation window, if accumulating)."""
        shared = self.shared_of([jnp.asarray(x) for x in self.stream.shared])
        step = jnp.asarray(self.stream.step, jnp.int32)
        if self.config.accumulate_steps > 1:
            window = accumulation.empty_window(params, self.config.accumulator_dtype)
            acc_grads = jax.tree_util.tree_unflatten(inputs.bare_treedef(self.plan.treedef), window.acc_grads)
            return OffloadState(step, shared, window.mini_step, acc_grads)
        self.expect_overlap(params, shared)
        return OffloadState(step, shared)

    def overlap(self, params: Any) -> Any:
        """``Offloader.overlap``: the identity whose backward starts the next update (traced)."""
        return self.overlap_route(params)

    def expect_overlap(self, grads: Sequence[Any], shared: Any, window: accumulation.Window | None = None) -> None:
        """Tells the overlap what the next step's update starts from: the tiers' step, the subgroups' devices
        (as ``grads`` are placed), the handle's ``shared`` state, and the window the next grads complete.

        Nothing is assumed where no overlap can run (see :attr:`Overlap.usable`), or from shapes alone
        (a resume or restore onto ``jax.ShapeDtypeStruct`` s): the next step then runs split.
        """
        if not self.overlap_route.usable or not all(isinstance(x, jax.Array) for x in grads):
            self.overlap_route.expect(None)
            return
        devices = self.sharding.devices(self.plan, grads)
        basis = self.overlap_route.basis(self.stream.step, devices, shared, self.stream.programs, window)
        self.overlap_route.expect(basis, grads)

    def _update_in_jit(self, call: Call, state: OffloadState) -> tuple[list, OffloadState]:
        """Traces the update as the in-jit route's host callbacks (see :mod:`jax_mlp._src.offload.in_jit`).

        Accumulation is refused here: its choice would be a ``lax.cond`` around the host callback,
        and that was seen to deadlock XLA's CPU runtime now and then (the callback's device work
        waiting behind the caller's next step), so it is refused rather than left to hang.
        """
        accumulation.refuse_multisteps()
        self.overlap_route.expect(None)  # the update runs after the backward anyway, in the same program
        if self.config.accumulate_steps > 1:
            raise OffloadError(
                f"mlp_offload with accumulate_steps={self.config.accumulate_steps} was called inside jax.jit; "
                "accumulation runs eagerly: call tx.update (or nnx.Optimizer.update) outside jit, with the jitted "
                "loss and gradients before it, or accumulate in your jitted step and create the mlp_offload "
                "without accumulate_steps"
            )
        uniform, new_shared = self.uniform(call)
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
            if int(carried.mini_step) == config.accumulate_steps - 1:  # the next grads complete the window
                self.expect_overlap(call.grads, shared, carried)
        else:
            leaves, step, shared = self._stream(call, means, state.step)
            window = accumulation.empty_window(carried.acc_grads, config.accumulator_dtype)
            self.overlap_route.expect(None)  # the next backward only starts a window
        acc_grads = jax.tree_util.tree_unflatten(inputs.bare_treedef(plan.treedef), window.acc_grads)
        return leaves, OffloadState(step, shared, window.mini_step, acc_grads)

    def _stream(self, call: Call, grads: list, step: jax.Array) -> tuple[list, jax.Array, Any]:
        """One eager update from ``step`` with ``grads``: the update leaves, the new step and the new shared state."""
        uniform, new_shared = self.uniform(call)
        params = call.params if self.overlap_route.needs_params else None  # the programs read none, on either route
        blocks = Blocks.of(self.plan, self.sharding, grads, params, uniform)
        results, notes = self.overlap_route.finish(blocks)
        if results is None:
            results = self.stream.update(int(step), blocks, EAGER, notes=notes)
        return self.sharding.assemble(self.plan, results), jnp.asarray(self.stream.step, jnp.int32), new_shared

    def apply(self, grads: Any, state: OffloadState, params: Any, extra_args: dict) -> tuple[Any, OffloadState]:
        """``Offloader.apply``: the new params, written over the donated old ones in their tree, and the new handle."""
        call = self.check("apply", grads, state, params, extra_args)
        _refuse_to_apply(call, self.config.accumulate_steps)
        inputs.check_distinct(self.plan, call.grads, call.params)
        del grads, params
        uniform, new_shared = self.uniform(call)
        notes = self.overlap_route.abandon("apply runs the update itself, from the params it donates")
        self.overlap_route.expect(None)  # an update with apply's donated params cannot start before apply
        blocks = Blocks.of(self.plan, self.sharding, call.grads, None, uniform)
        results = NewParams(self.plan, self.sharding.block_map(call.params), call.grads, blocks.grads)
        updated = self.stream.update(int(state.step), blocks, LATE_PUT, results, notes)
        new_leaves = self.sharding.assemble(self.plan, updated)
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
