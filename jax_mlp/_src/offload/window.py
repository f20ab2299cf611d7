"""The accumulation window: the gradients of ``accumulate_steps`` calls averaged on the device.

The semantics and the arithmetic are those of ``optax.MultiSteps(inner, every_k_schedule=k)``: each
call folds its gradients into a running mean, ``acc + (g - acc) / (n + 1)`` (Welford's form, as
MultiSteps computes it), and the k-th call hands that mean, in the gradients' dtype, to the update
that streams the state. The window (the micro-step count and the running mean) lives in the
user's ``OffloadState``, so ``update`` stays a function of its inputs; the route that runs it is
``offload/accumulation.py``.

``optax.MultiSteps`` itself cannot wrap ``mlp_offload``: it runs the inner update on every
micro-step and keeps the old state with ``jnp.where``, and storage cannot roll back.
:func:`refuse_multisteps` stops it at its first call.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_mlp._src.errors import OffloadError


class Window(NamedTuple):
    """Where one accumulation window stands.

    Attributes:
      mini_step: the calls accumulated so far in this window (int32 scalar, ``0`` to ``k - 1``).
      acc_grads: per param leaf, the running mean of those calls' gradients, in the accumulator dtype.
    """

    mini_step: jax.Array
    acc_grads: list[jax.Array]


def empty_window(params: Sequence[Any], dtype: np.dtype) -> Window:
    """A window with nothing accumulated: zeros shaped and placed as each param leaf (or its ``ShapeDtypeStruct``).

    A concrete leaf's zeros keep its sharding and commitment (``zeros_like``), so a jitted step
    over params and state does not recompile when the state comes back from ``update``.
    """
    zeros = [
        jnp.zeros_like(p, dtype=dtype)
        if isinstance(p, jax.Array)
        else jnp.zeros(p.shape, dtype, device=getattr(p, "sharding", None))
        for p in params
    ]
    return Window(jnp.zeros([], jnp.int32), zeros)


@functools.partial(jax.jit, static_argnames="accumulator_dtype")
def add(grads: Sequence[jax.Array], window: Window, accumulator_dtype: np.dtype) -> tuple[list[jax.Array], Window]:
    """Folds one call's gradients into the window.

    Args:
      grads: the call's gradient leaves.
      window: the window before this call.
      accumulator_dtype: the dtype the running mean is kept in.

    Returns:
      The mean so far in each gradient's dtype (what the update streams with when the window is
      full), and the window after this call.
    """
    means = [a + (g - a) / (window.mini_step + 1) for g, a in zip(grads, window.acc_grads, strict=True)]
    carried = Window(window.mini_step + 1, [m.astype(accumulator_dtype) for m in means])
    return [m.astype(g.dtype) for g, m in zip(grads, means, strict=True)], carried


@functools.partial(jax.jit, static_argnames="dtypes")
def zero_updates(grads: Sequence[jax.Array], dtypes: tuple[np.dtype, ...]) -> list[jax.Array]:
    """What a micro-step returns: zeros placed as each gradient leaf, in the dtype of that leaf's updates."""
    return [_zeros_placed_as(g).astype(dtype) for g, dtype in zip(grads, dtypes, strict=True)]


def _zeros_placed_as(x: jax.Array) -> jax.Array:
    """Zeros with ``x``'s shape, dtype and sharding, inside jit.

    ``jnp.zeros_like`` there needs a mesh context for arrays on an Explicit mesh (the default of
    ``jax.make_mesh``); an element-wise ``where`` takes ``x``'s sharding without one.
    """
    return jnp.where(True, 0, x)


_MULTISTEPS_CODE = frozenset({optax.MultiSteps.init.__code__, optax.MultiSteps.update.__code__})


def refuse_multisteps() -> None:
    """Raises if the call comes, through any chain, from ``optax.MultiSteps``' ``init`` or ``update``.

    MultiSteps traces the inner update under ``lax.cond`` on every micro-step and keeps the old
    state with ``jnp.where``; the offloaded state would advance on every call while the handle
    stays behind. Found on the call stack, so it is refused before anything is read or written.

    Raises:
      OffloadError: naming MultiSteps and the remedy, ``accumulate_steps``.
    """
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code in _MULTISTEPS_CODE:
            raise OffloadError(
                "optax.MultiSteps cannot wrap mlp_offload: it runs the inner update on every micro-step and keeps "
                "the old state with jnp.where, but offloaded state on storage cannot roll back. Drop MultiSteps and "
                "pass accumulate_steps=k to mlp_offload instead, e.g. optax.chain(optax.clip_by_global_norm(1.0), "
                "jax_mlp.mlp_offload(inner, paths=..., accumulate_steps=k)): it averages the gradients of k calls on "
                "the device as MultiSteps does, and only every k-th call streams the state. Transformations before "
                "mlp_offload in the chain then see each call's gradients"
            )
        frame = frame.f_back
