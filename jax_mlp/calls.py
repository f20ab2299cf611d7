"""One call of ``update`` or ``apply``, checked: the handle, the user's trees and the extra arguments.

``update`` and ``apply`` share this prologue. It turns what the user passed into a :class:`Call`
(leaves checked against the plan, the handle's shared state as a tree, extra arguments as arrays)
and gives every subgroup's uniform values. A new combination of extra-argument shapes is run
through the optimizer check once.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from jax_mlp import dependence, inputs
from jax_mlp.errors import OffloadError
from jax_mlp.partition import Plan
from jax_mlp.programs import Programs, Uniform
from jax_mlp.state import OffloadState


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


class CallChecks:
    """The checks of one initialised offloader's calls.

    Args:
      inner: the inner optimizer (taking extra arguments).
      plan: the subgroups.
      programs: the plan's programs (the shared state's shapes and successor).
      accumulate_steps: the offloader's accumulation window (1: none).
      declared_extra_args: the extra-argument signature the optimizer check passed at ``init``.
    """

    def __init__(
        self,
        inner: optax.GradientTransformationExtraArgs,
        plan: Plan,
        programs: Programs,
        accumulate_steps: int,
        declared_extra_args: Any,
    ):
        self._inner = inner
        self._plan = plan
        self._programs = programs
        self._accumulate_steps = accumulate_steps
        self._checked_extra_args = {declared_extra_args}
        self._shared_treedef = jax.tree_util.tree_structure(programs.shared_shapes)

    def check(self, verb: str, grads: Any, state: Any, params: Any, extra_args: dict[str, Any]) -> Call:
        """Checks a call of ``verb`` (``"update"`` or ``"apply"``) and returns it as a :class:`Call`.

        Raises:
          OffloadError: the handle is not this offloader's, a tree, shape or dtype differs from the
            plan, or the extra arguments are not arrays; ``CoupledOptimizerError`` for extra arguments
            that couple leaves.
        """
        self._check_handle(verb, state)
        grad_leaves, param_leaves = inputs.check_update_inputs(self._plan, grads, params)
        extra = self._checked_extra(extra_args)
        shared = jax.tree_util.tree_unflatten(
            self._shared_treedef, inputs.check_shared(self._programs.shared_shapes, state.shared)
        )
        traced = inputs.is_traced((grad_leaves, state, param_leaves, extra))
        params_tree = None if params is None else jax.tree_util.tree_structure(params)
        return Call(grad_leaves, param_leaves, shared, extra, traced, jax.tree_util.tree_structure(grads), params_tree)

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
        accumulating = self._accumulate_steps > 1
        if accumulating != (state.mini_step is not None and state.acc_grads is not None):
            have = "has no accumulation window" if accumulating else "carries an accumulation window"
            raise OffloadError(
                f"this mlp_offload has accumulate_steps={self._accumulate_steps}, but the opt_state passed to "
                f"{verb} {have}: pass the OffloadState that this mlp_offload's init (or restore) returned"
            )

    def _checked_extra(self, extra_args: dict[str, Any]) -> dict[str, jax.Array]:
        """The extra arguments as arrays; the optimizer is checked with each new combination of their shapes."""
        extra = inputs.extra_arrays(extra_args)
        signature = tuple(sorted((k, jax.ShapeDtypeStruct(v.shape, v.dtype)) for k, v in extra.items()))
        if signature not in self._checked_extra_args:
            dependence.check_extra_args(self._inner, self._plan, extra)
            self._checked_extra_args.add(signature)
        return extra
