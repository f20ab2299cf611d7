"""Compressed optimizer state: ``quantized_state(inner, codec)`` keeps ``inner``'s state in bf16 or int8.

A plain optax transformation: ``init`` compresses ``inner.init``; ``update`` decompresses, runs
``inner.update`` and compresses the new state. In memory it is an 8-bit (or bf16) optimizer; inside
``mlp_offload`` it runs in each subgroup's jitted program, so the records, the host cache, PCIe and
the disks all carry the small form.

Which leaves are compressed is decided from the part of a leaf's shape that a row split keeps
(``shape[1:]``), so a row chunk of a leaf is compressed exactly as those rows of the whole leaf:
floating leaves wider than the codec with ``ndim >= 2`` and a last axis of at least ``MIN_LAST_AXIS``.
Integer counts, scalars, vectors (biases, norms) and narrow leaves stay as they are.

- ``"bf16"``: round to nearest even, or stochastic rounding whose random bits are a hash of the
  bits bf16 keeps, the column, the step and the leaf's tree path: no PRNG state, reproducible, the
  same for a row chunk as for those rows of the whole leaf, so bits never depend on the tiering.
- ``"int8"``: blocks of ``BLOCK_SIZE`` along the last axis, each with a float32 scale; the codes are
  uint8 indices into a dynamic (exponent + fraction) map. A block that holds a negative value uses
  the signed map on ``x / absmax`` (its scale is stored negated); a non-negative block (adam's ``nu``)
  uses the unsigned map on ``sqrt(x) / max sqrt(x)``. Its seven decades of ``sqrt`` span fourteen
  of ``nu``, so small ``nu`` never underflows to zero, as a linear absmax map's does (measured in
  ``benchmarks/state_codecs.py``; docs/concepts.md has the numbers).
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

CODECS = ("bf16", "int8")
BLOCK_SIZE = 256
MIN_LAST_AXIS = 16


def dynamic_map(*, signed: bool, decades: int = 7) -> np.ndarray:
    """The 256 sorted values of a dynamic quantization map in [-1, 1] (signed) or [0, 1].

    Decade ``i`` (from ``10**-(decades-1)`` up to 1) gets ``2**i`` fraction steps (twice as many
    when unsigned), placed at the midpoints of an even split of ``[0.1, 1]`` times the decade, so
    the relative spacing is about the same in every decade; 0 and 1 are exact (Dettmers, "8-bit
    approximations for parallelism in deep learning", arXiv 1511.04561).
    """
    values = [0.0, 1.0]
    for i in range(decades):
        steps = 2 ** (i + (0 if signed else 1))
        edges = np.linspace(0.1, 1.0, steps + 1)
        magnitudes = 10.0 ** (i - decades + 1) * (edges[:-1] + edges[1:]) / 2
        values += list(magnitudes) + (list(-magnitudes) if signed else [])
    if len(values) != 256:
        raise ValueError(f"a dynamic map of {decades} decades has {len(values)} values, not 256")
    return np.sort(np.asarray(values, np.float32))


_SIGNED_MAP = dynamic_map(signed=True)
_UNSIGNED_MAP = dynamic_map(signed=False)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Bf16Leaf:
    """A state leaf held in bfloat16; ``dtype`` is the dtype it is restored to."""

    value: jax.Array
    dtype: np.dtype = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Leaf:
    """A state leaf as blockwise 8-bit codes.

    Attributes:
      codes: uint8 indices into the dynamic map, the leaf's shape.
      scales: float32, ``(*shape[:-1], blocks)``: per row, one scale per block of the last axis, so
        the rows of a leaf's state are the state of those rows. Negative: a signed block.
      dtype: the dtype the leaf is restored to.
    """

    codes: jax.Array
    scales: jax.Array
    dtype: np.dtype = dataclasses.field(metadata=dict(static=True))


class QuantizedState(NamedTuple):
    """The state of :func:`quantized_state`: its step count and ``inner``'s compressed state."""

    count: jax.Array
    inner: Any


def compressible(leaf: Any, codec: str) -> bool:
    """Whether ``codec`` compresses a state leaf; decided from ``shape[1:]``, so row chunks agree."""
    dtype = np.dtype(leaf.dtype)
    width = 2 if codec == "bf16" else 1
    return (
        jnp.issubdtype(dtype, jnp.floating)
        and dtype.itemsize > width
        and leaf.ndim >= 2
        and leaf.shape[-1] >= MIN_LAST_AXIS
    )


def _mix(x: jax.Array) -> jax.Array:
    """A 32-bit integer hash with good avalanche (the "lowbias32" finaliser)."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _stochastic_bf16(x: jax.Array, count: jax.Array, seed: int) -> jax.Array:
    """Rounds float32 ``x`` to bf16 up in magnitude with probability (dropped bits) / 2**16.

    The random bits hash the value's upper 16 bits (those bf16 keeps), its column, the step and the
    leaf's seed: no PRNG state, and nothing that depends on the row offset of a row chunk. Hashing
    only the kept bits means a value one fp32 ulp off (another XLA fusion) draws the same bits, so
    its rounding changes as rarely as round to nearest even does.
    """
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    column = jax.lax.broadcasted_iota(jnp.uint32, x.shape, x.ndim - 1)
    salt = _mix(count.astype(jnp.uint32) * np.uint32(0x9E3779B9) ^ np.uint32(seed))
    noise = _mix(_mix((bits >> 16) ^ salt) + column) & np.uint32(0xFFFF)
    rounded = jax.lax.bitcast_convert_type((bits + noise) & np.uint32(0xFFFF0000), jnp.float32)
    return jnp.where(jnp.isfinite(x), rounded, x).astype(jnp.bfloat16)


def _blocks(x: jax.Array) -> jax.Array:
    """``x`` as ``(*shape[:-1], blocks, BLOCK_SIZE)``, the last axis padded with zeros."""
    n = x.shape[-1]
    blocks = -(-n // BLOCK_SIZE)
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, blocks * BLOCK_SIZE - n)])
    return padded.reshape(*x.shape[:-1], blocks, BLOCK_SIZE)


def _nearest(values: np.ndarray, x: jax.Array) -> jax.Array:
    """The index of the entry of the sorted map ``values`` nearest to each element of ``x``."""
    midpoints = jnp.asarray((values[1:] + values[:-1]) / 2)
    return jnp.searchsorted(midpoints, x).astype(jnp.uint8)


def quantize_int8(x: jax.Array) -> Int8Leaf:
    """Blockwise 8-bit codes of ``x`` along its last axis (see the module docstring)."""
    blocks = _blocks(x.astype(jnp.float32))
    non_negative = jnp.all(blocks >= 0, axis=-1, keepdims=True)
    magnitude = jnp.where(non_negative, jnp.sqrt(jnp.abs(blocks)), blocks)
    absmax = jnp.max(jnp.abs(magnitude), axis=-1, keepdims=True)
    normalized = magnitude / jnp.where(absmax > 0, absmax, 1)
    codes = jnp.where(non_negative, _nearest(_UNSIGNED_MAP, normalized), _nearest(_SIGNED_MAP, normalized))
    n = x.shape[-1]
    codes = codes.reshape(*x.shape[:-1], -1)[..., :n]
    scales = jnp.where(non_negative, absmax, -absmax)[..., 0]
    return Int8Leaf(codes, scales, np.dtype(x.dtype))


def dequantize_int8(leaf: Int8Leaf) -> jax.Array:
    """The values an :class:`Int8Leaf` stands for, in its dtype."""
    n = leaf.codes.shape[-1]
    codes = _blocks(leaf.codes.astype(jnp.int32))
    scales = leaf.scales[..., None]
    unsigned = (jnp.asarray(_UNSIGNED_MAP)[codes] * scales) ** 2
    signed = jnp.asarray(_SIGNED_MAP)[codes] * -scales
    values = jnp.where(scales >= 0, unsigned, signed)
    return values.reshape(*leaf.codes.shape[:-1], -1)[..., :n].astype(leaf.dtype)


def _is_compressed(x: Any) -> bool:
    return isinstance(x, Bf16Leaf | Int8Leaf)


def compress(state: Any, codec: str, count: jax.Array, *, stochastic: bool = False) -> Any:
    """``state`` with each :func:`compressible` leaf compressed by ``codec``.

    Args:
      state: an optax state tree.
      codec: ``"bf16"`` or ``"int8"``.
      count: the step, which seeds stochastic rounding.
      stochastic: bf16 only: stochastic rounding instead of round to nearest even.
    """

    def one(path: Any, leaf: Any) -> Any:
        if not compressible(leaf, codec):
            return leaf
        if codec == "int8":
            return quantize_int8(leaf)
        if stochastic:
            return Bf16Leaf(
                _stochastic_bf16(leaf, count, zlib.crc32(jax.tree_util.keystr(path).encode())), np.dtype(leaf.dtype)
            )
        return Bf16Leaf(leaf.astype(jnp.bfloat16), np.dtype(leaf.dtype))

    return jax.tree_util.tree_map_with_path(one, state)


def decompress(state: Any) -> Any:
    """The inverse of :func:`compress`: each compressed leaf back in its dtype."""

    def one(leaf: Any) -> Any:
        if isinstance(leaf, Int8Leaf):
            return dequantize_int8(leaf)
        if isinstance(leaf, Bf16Leaf):
            return leaf.value.astype(leaf.dtype)
        return leaf

    return jax.tree_util.tree_map(one, state, is_leaf=_is_compressed)


def quantized_state(
    inner: optax.GradientTransformation, codec: str, *, stochastic: bool = False
) -> optax.GradientTransformationExtraArgs:
    """Keeps ``inner``'s state compressed between steps: ``"bf16"`` or blockwise ``"int8"``.

    The updates are ``inner``'s, computed from the decompressed state; only the state that is kept
    is rounded. Works in memory and as the inner optimizer of :func:`jax_mlp.mlp_offload`.

    Args:
      inner: an optax transformation, typically adam-like (the state of each param leaf has its shape).
      codec: ``"bf16"`` (round to nearest even) or ``"int8"`` (blocks of 256 along the last axis,
        dynamic map, ``sqrt`` for non-negative blocks).
      stochastic: with ``"bf16"``, round stochastically, reproducibly (a hash of value, column,
        step and leaf path, not a PRNG).

    Returns:
      An optax transformation whose state is a :class:`QuantizedState`.

    Raises:
      ValueError: for an unknown codec, or ``stochastic`` with ``"int8"``.
    """
    if codec not in CODECS:
        raise ValueError(f"quantized_state codec {codec!r} is not one of {CODECS}")
    if stochastic and codec != "bf16":
        raise ValueError(f"stochastic rounding is a bf16 option; codec {codec!r} rounds to the nearest code")
    inner = optax.with_extra_args_support(inner)

    def init(params: Any) -> QuantizedState:
        count = jnp.zeros([], jnp.int32)
        return QuantizedState(count, compress(inner.init(params), codec, count, stochastic=stochastic))

    def update(updates: Any, state: QuantizedState, params: Any = None, **extra_args: Any) -> tuple:
        count = optax.safe_increment(state.count)
        updates, new_inner = inner.update(updates, decompress(state.inner), params, **extra_args)
        return updates, QuantizedState(count, compress(new_inner, codec, count, stochastic=stochastic))

    return optax.GradientTransformationExtraArgs(init, update)
