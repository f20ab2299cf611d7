"""What a route is: a checked call in, an outcome out; and the checks that turn what the user passed into a call.

Every call of ``update`` or ``apply`` is checked once (:class:`Calls`: the handle, the trees
against the plan, memory kinds, the shared state, extra arguments checked once per signature) and
becomes a :class:`Call`. The offloader hands it to one :class:`Route`, picked by what the call is,
and the route returns an :class:`Outcome`: the leaves, the new handle, and what the next call may
assume (the basis of an update the next backward may start, see ``offload/overlap.py``). The
offloader tells the overlap that basis in one place, after every route.

The routes (docs/architecture.md, "Routes"), one module each:

- ``split``: an eager ``update``, or the finish of one the backward started (``overlap``);
- ``fused``: ``apply``, the update written over the donated params;
- ``in_jit``: ``update`` traced inside ``jax.jit``, as host callbacks;
- ``accumulation``: one call of a gradient-accumulation window (its last goes the split route).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import optax

from jax_mlp._src.config import OffloadConfig
from jax_mlp._src.errors import OffloadError
from jax_mlp._src.offload import inputs
from jax_mlp._src.offload.overlap import Overlap
from jax_mlp._src.plan import optimizer_check
from jax_mlp._src.plan.partition import Plan
from jax_mlp._src.plan.programs import Programs, Uniform
from jax_mlp._src.plan.sharding import LeafSharding
from jax_mlp._src.state import OffloadState
from jax_mlp._src.stream.state_stream import StateStream


class Call(NamedTuple):
    """A checked call of ``update`` or ``apply``.

    Attributes:
      verb: ``"update"`` or ``"apply"``.
      grads: the gradient leaves.
      params: the param leaves, or None when not given.
      state: the handle given.
      shared: the handle's shared state, as a tree.
      extra: the extra arguments of ``inner.update``, as arrays.
      traced: whether the call is being traced (inside ``jax.jit``).
      grads_tree: the structure of the grads as given: the updates come back in it, as optax's do.
      params_tree: the structure of the params as given (``apply``'s new params come back in it), or None.
    """

    verb: str
    grads: list[jax.Array]
    params: list[jax.Array] | None
    state: OffloadState
    shared: Any
    extra: dict[str, jax.Array]
    traced: bool
    grads_tree: Any
    params_tree: Any


class Outcome(NamedTuple):
    """What a route gives back.

    Attributes:
      leaves: the updates (or, for ``apply``, the new params), as leaves.
      tree: the structure they go back in.
      state: the new handle.
      expect: what an update the next backward starts may assume (an ``overlap.Basis``), or None: it starts none.
    """

    leaves: list[Any]
    tree: Any
    state: OffloadState
    expect: Any

    def result(self) -> tuple[Any, OffloadState]:
        """``(updates or new params, new handle)``, as ``update`` and ``apply`` return them."""
        return jax.tree_util.tree_unflatten(self.tree, self.leaves), self.state


class Route(Protocol):
    """A way a call reaches the state stream."""

    def run(self, call: Call) -> Outcome:
        """Runs ``call``; raises after undoing anything it started, so the tiers keep the previous step."""
        ...


class Calls:
    """The checks every call of one initialised offload goes through, and what every subgroup is given alike.

    Args:
      inner: the inner optimizer (taking extra arguments).
      config: the offload's options.
      plan: the subgroups.
      sharding: each leaf's sharding and owned shards, as at ``init``.
      programs: the plan's subgroup programs (the shared state's shapes and update).
    """

    def __init__(
        self,
        inner: optax.GradientTransformationExtraArgs,
        config: OffloadConfig,
        plan: Plan,
        sharding: LeafSharding,
        programs: Programs,
    ):
        self._inner, self._config, self._plan, self._sharding, self._programs = inner, config, plan, sharding, programs
        self._checked_extra_args = {config.extra_args}  # the signatures the optimizer check passed
        self._shared_treedef = jax.tree_util.tree_structure(programs.shared_shapes)

    def check(self, verb: str, grads: Any, state: Any, params: Any, extra_args: dict[str, Any]) -> Call:
        """Checks a call of ``verb`` (``"update"`` or ``"apply"``) and returns it as a :class:`Call`.

        Raises:
          OffloadError: the handle is not this offloader's, a tree, shape, dtype or memory kind differs
            from the plan, or the extra arguments are not arrays; ``CoupledOptimizerError`` for extra
            arguments that couple leaves.
        """
        self._check_handle(verb, state)
        grad_leaves, param_leaves = inputs.check_update_inputs(self._plan, grads, params)
        inputs.check_memory_kinds(self._plan, self._sharding.kinds, grad_leaves, param_leaves)
        extra = self._checked_extra(extra_args)
        shared = self.shared_of(inputs.check_shared(self._programs.shared_shapes, state.shared))
        traced = inputs.is_traced((grad_leaves, state, param_leaves, extra))
        params_tree = None if params is None else jax.tree_util.tree_structure(params)
        grads_tree = jax.tree_util.tree_structure(grads)
        return Call(verb, grad_leaves, param_leaves, state, shared, extra, traced, grads_tree, params_tree)

    def uniform(self, call: Call) -> tuple[Uniform, Any]:
        """What every subgroup is given alike (the shared state, its successor, the extra args), and that successor."""
        new_shared = self._programs.shared_update(call.shared, call.extra)
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
        accumulating = self._config.accumulate_steps > 1
        if accumulating != (state.mini_step is not None and state.acc_grads is not None):
            have = "has no accumulation window" if accumulating else "carries an accumulation window"
            raise OffloadError(
                f"this mlp_offload has accumulate_steps={self._config.accumulate_steps}, but the opt_state passed to "
                f"{verb} {have}: pass the OffloadState that this mlp_offload's init (or restore) returned"
            )

    def _checked_extra(self, extra_args: dict[str, Any]) -> dict[str, jax.Array]:
        """The extra arguments as arrays; the optimizer is checked with each new combination of their shapes."""
        extra = inputs.extra_arrays(extra_args)
        signature = tuple(sorted((k, jax.ShapeDtypeStruct(v.shape, v.dtype)) for k, v in extra.items()))
        if signature not in self._checked_extra_args:
            optimizer_check.check_extra_args(self._inner, self._plan, extra)
            self._checked_extra_args.add(signature)
        return extra


class Parts(NamedTuple):
    """What every route of one offload is built from.

    Attributes:
      calls: the call checks (and the values every subgroup is given alike).
      config: the options.
      plan: the subgroups.
      sharding: each leaf's sharding and owned shards, as at ``init``.
      stream: the offloaded state.
      overlap: the update the backward may start (``offload.overlap`` in the loss).
      needs_params: whether the update reads the params (the inner optimizer does, or a master is kept).
    """

    calls: Calls
    config: OffloadConfig
    plan: Plan
    sharding: LeafSharding
    stream: StateStream
    overlap: Overlap
    needs_params: bool
