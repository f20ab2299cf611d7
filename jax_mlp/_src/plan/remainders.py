"""fp32 masters stored as their low 16 bits: the bf16 params are the high half, a signed int16 the rest.

With bf16 params and an fp32 master, the high half of each master is (up to rounding) the bf16
param the device already holds, so a record needs only the low 16 bits: the master moves as 2 bytes
per param instead of 4. This is NVIDIA Transformer Engine's and Apex ``FusedAdam``'s
``store_param_remainders``, written here with bit operations in jnp.

:func:`split` rounds the master to its bf16 word by **round half up on the magnitude** (the low half
``>= 0x8000`` carries into the high half) and keeps the low half as an int16: negative exactly when
it carried. :func:`rebuild` undoes the carry. Round-to-nearest-even would not do: a tie rounded down
and a tie rounded up leave the same even word, and the remainder could not tell them apart.

Every finite master and both infinities come back bit for bit; a NaN comes back a NaN of the same
sign (its payload's low half is not kept). :func:`rebuild` follows the params: for *every* bf16 word
``p`` and remainder ``r``, ``split(rebuild(p, r))`` gives back the word ``p``, so params the user
changed between steps (loaded, averaged) are what the next update starts from, within half a bf16
ulp. The pairs no split makes (``p`` zero or non-finite with a remainder that points past it) rebuild
as the word itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

REMAINDER_DTYPE = np.dtype(np.int16)
"""The dtype a record stores a remainder master in."""

_EXPONENT = 0x7F800000
_MAGNITUDE_INF = 0x7F80  # of a bf16 word
_HIGH_QUIET = 0x0040  # a mantissa bit of the bf16 word, set so a NaN's word never reads as inf


def held_as_remainders(master_fields: Sequence[Any]) -> tuple[bool, ...]:
    """Per master field of a record layout (anything with a ``dtype``), whether it holds a remainder."""
    return tuple(np.dtype(field.dtype) == REMAINDER_DTYPE for field in master_fields)


def stored_master_dtype(param_dtype: np.dtype, master_dtype: np.dtype, storage: str) -> np.dtype:
    """The dtype a record holds a leaf's master in: int16 remainders for bf16 params with an fp32 master
    and ``storage="remainder"``, else the master dtype (other dtypes have no such split)."""
    if storage == "remainder" and np.dtype(master_dtype) == np.float32 and np.dtype(param_dtype) == jnp.bfloat16:
        return REMAINDER_DTYPE
    return np.dtype(master_dtype)


def split(master: jax.Array) -> tuple[jax.Array, jax.Array]:
    """An fp32 master as its bf16 word (round half up on the magnitude) and its int16 remainder.

    Returns:
      ``(params, remainder)``: bf16 and int16 arrays of the master's shape.
    """
    bits = jax.lax.bitcast_convert_type(jnp.asarray(master, jnp.float32), jnp.uint32)
    high = (bits >> 16).astype(jnp.uint16)
    low = (bits & 0xFFFF).astype(jnp.uint16)
    finite = (bits & _EXPONENT) != _EXPONENT
    # A finite master's magnitude is at most 0x7F7F_FFFF: carrying into it can reach inf, never the sign.
    high = jnp.where(finite & (low >= 0x8000), high + 1, high)
    nan_as_inf = ~finite & ((bits & 0x007FFFFF) != 0) & ((high & 0x7F) == 0)
    high = jnp.where(nan_as_inf, high | _HIGH_QUIET, high)
    remainder = jnp.where(finite, jax.lax.bitcast_convert_type(low, jnp.int16), jnp.int16(0))
    return jax.lax.bitcast_convert_type(high, jnp.bfloat16), remainder


def rebuild(params: jax.Array, remainder: jax.Array) -> jax.Array:
    """The fp32 master of bf16 ``params`` and their int16 ``remainder``: :func:`split` undone."""
    high = jax.lax.bitcast_convert_type(jnp.asarray(params, jnp.bfloat16), jnp.uint16).astype(jnp.uint32)
    magnitude = high & 0x7FFF
    carried = remainder < 0
    # A carry came from below a word in (0, inf]; a non-negative remainder extends a finite word.
    usable = jnp.where(carried, (magnitude != 0) & (magnitude <= _MAGNITUDE_INF), magnitude < _MAGNITUDE_INF)
    below = jnp.where(carried, high - 1, high)
    low = jax.lax.bitcast_convert_type(jnp.asarray(remainder, jnp.int16), jnp.uint16).astype(jnp.uint32)
    bits = jnp.where(usable, (below << 16) | low, high << 16)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def landing_update(params: jax.Array, new_params: jax.Array, dtype: np.dtype = np.float32) -> jax.Array:
    """The update ``u`` in ``dtype`` for which ``optax.apply_updates(params, u)`` gives ``new_params`` exactly.

    ``p + (p_new - p)`` (in fp32 for bf16 params) is exact where the two are within a factor of two
    (Sterbenz), and further apart it rounds far below half a bf16 ulp, so the cast lands on ``p_new``.
    Where the word does not change, ``u`` is ``-0.0``: ``inf - inf`` would be NaN, and ``-0 + 0`` is
    ``+0``. What no addition can do stays off: a ±inf or NaN param made finite, ``+0`` made ``-0``,
    or a step beyond the range of ``dtype``; the fused ``apply`` writes the words in every case.

    Args:
      params: the params the user holds.
      new_params: the params to land on, in the params' dtype.
      dtype: the dtype of the update (the master's).
    """
    same = _bits(params) == _bits(new_params)
    difference = new_params.astype(dtype) - params.astype(dtype)
    return jnp.where(same, jnp.asarray(-0.0, dtype), difference)


def _bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
