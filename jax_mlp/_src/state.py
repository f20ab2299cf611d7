"""The handle the user holds: :class:`OffloadState`, the step and the state every subgroup holds alike."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax


class OffloadState(NamedTuple):
    """The optimizer state the user holds: the number of updates applied, and the shared state.

    The inner optimizer's state is in the tiers; ``step`` ties this handle to the step they hold.
    ``shared`` is the part of the inner state that every subgroup holds alike: ``inner.init`` of
    the params with ``None`` for every leaf (counts, injected hyperparameters; None before ``init``).
    Read it to log it; replace a value between updates (``state.hyperparams["learning_rate"] = 1e-4``)
    and the next update gives it to every subgroup. With ``accumulate_steps > 1`` it also carries the
    accumulation window, on the device.

    Attributes:
      step: the updates applied so far (int32 scalar).
      shared: the shared inner state (see above).
      mini_step: the calls accumulated since the last update, or None without accumulation.
      acc_grads: the running mean of those calls' gradients, a tree like the params in
        ``accumulator_dtype``, or None without accumulation.
    """

    step: jax.Array
    shared: Any = None
    mini_step: jax.Array | None = None
    acc_grads: Any = None

    @property
    def hyperparams(self) -> dict[str, Any]:
        """The injected hyperparameters of an ``optax.inject_hyperparams`` inner optimizer, as in optax."""
        if not hasattr(self.shared, "hyperparams"):
            raise AttributeError(
                "this OffloadState has no hyperparams: the inner optimizer is not made with optax.inject_hyperparams"
            )
        return self.shared.hyperparams
