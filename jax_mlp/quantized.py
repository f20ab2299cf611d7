"""Compressed optimizer state: ``quantized_state(inner, codec)`` keeps ``inner``'s state in bf16 or int8.

A plain optax transformation: ``init`` compresses ``inner.init``; ``update`` decompresses, runs
``inner.update`` and compresses the new state. In memory it is an 8-bit (or bf16) optimizer; inside
``mlp_offload`` it runs in each subgroup's jitted program, so the records, the host cache, PCIe and
the disks all carry the small form.

Which leaves are compressed is decided from the part of a leaf's shape that a row split keeps
(``shape[1:]``), so a row chunk of a leaf is compressed exactly as those rows of the whole leaf:
float32 leaves with ``ndim >= 2`` and a last axis of at least ``MIN_LAST_AXIS``. Integer counts,
scalars, vectors (biases, norms), narrow leaves and state already in low precision stay as they are.
A compressed leaf is one plain array, uint8 (int8 codes) or uint16 (bf16 bits), so ``nnx.Optimizer``,
orbax and ``mlp_offload``'s records handle it like any other leaf.

- ``"bf16"``: round to nearest even, or stochastic rounding whose random bits are a hash of the
  bits bf16 keeps, the column, the step and the leaf's tree path: no PRNG state, reproducible, the
  same for a row chunk as for those rows of the whole leaf, so bits never depend on the tiering.
- ``"int8"``: blocks of ``BLOCK_SIZE`` along the last axis, each with a float32 scale kept at the
  end of its row; the codes are uint8 indices into a dynamic (exponent + fraction) map, the nearest entry
  found in closed form (``_nearest``: a few compares, a multiply, one lookup). A block that holds a negative value uses
  the signed map on ``x / absmax`` (its scale is stored negated); a non-negative block (adam's ``nu``)
  uses the unsigned map on ``sqrt(x) / max sqrt(x)``. Its seven decades of ``sqrt`` span fourteen
  of ``nu``, so small ``nu`` never underflows to zero, as a linear absmax map's does (measured in
  ``benchmarks/state_codecs.py``; docs/concepts.md has the numbers).
"""

from __future__ import annotations

import zlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_mlp.errors import OffloadError

CODECS = ("bf16", "int8")
BLOCK_SIZE = 256
MIN_LAST_AXIS = 16


def dynamic_map(*, signed: bool, decades: int = 7) -> np.ndarray:
    """The 256 sorted values of a dynamic quantization map in [-1, 1] (signed) or [0, 1].

    Decade ``i`` (from ``10**-(decades-1)`` up to 1) gets ``2**i`` fraction steps (twice as many
    when unsigned), placed at the midpoints of an even split of ``[0.1, 1]`` times the decade: fine
    steps near the block's maximum, coarser ones far below it, and only values under half the
    smallest entry (1.6e-7 of the maximum unsigned, 2.8e-7 signed) round to 0; 0 and 1 are exact (Dettmers, "8-bit
    approximations for parallelism in deep learning", arXiv 1511.04561).
    """
    values = [0.0, 1.0]
    for i in range(decades):
        steps = 2 ** (i + (0 if signed else 1))
        edges = np.linspace(0.1, 1.0, steps + 1)
        magnitudes = 10.0 ** (i - decades + 1) * (edges[:-1] + edges[1:]) / 2
        values += list(magnitudes) + (list(-magnitudes) if signed else [])
    if len(values) != 256:
        raise OffloadError(
            f"dynamic_map(decades={decades}) has {len(values)} values, but an int8 code indexes 256: use decades=7"
        )
    return np.sort(np.asarray(values, np.float32))


_SIGNED_MAP = dynamic_map(signed=True)
_UNSIGNED_MAP = dynamic_map(signed=False)


class QuantizedState(NamedTuple):
    """The state of :func:`quantized_state`: its step count and ``inner``'s compressed state."""

    count: jax.Array
    inner: Any


def compressible(leaf: Any) -> bool:
    """Whether a state leaf is compressed: float32, ``ndim >= 2``, a last axis of ``MIN_LAST_AXIS`` or more.

    Decided from ``shape[1:]`` only, so a row chunk of a leaf is compressed as the whole leaf is.
    """
    return np.dtype(leaf.dtype) == np.float32 and leaf.ndim >= 2 and leaf.shape[-1] >= MIN_LAST_AXIS


def packed_width(n: int) -> int:
    """The last axis of an int8-coded row of ``n`` values: ``n`` codes, then 4 bytes per block's scale."""
    return n + 4 * -(-n // BLOCK_SIZE)


def stored_fraction(codec: str) -> float:
    """Bytes a codec keeps per byte of float32 state, for large leaves: ``"none"``, ``"bf16"`` or ``"int8"``."""
    return {"none": 1.0, "bf16": 0.5, "int8": (1 + 4 / BLOCK_SIZE) / 4}[codec]


def _unpacked_width(width: int) -> int:
    # packed_width is strictly increasing, and its inverse is this: the block count is ceil(width / (B + 4)).
    return width - 4 * -(-width // (BLOCK_SIZE + 4))


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
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
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


def _midpoints(values: np.ndarray) -> np.ndarray:
    return (values[1:] + values[:-1]) / 2


class _Levels(NamedTuple):
    """A map's closed form, per level (0, decade 0 to 6, 1): its lower bound and its magnitude index there.

    ``bounds[k]`` is the float32 midpoint below the first entry of level ``k + 1``, so a value's level is the
    count of bounds under it, exactly as the search would find. In a decade of ``steps`` entries placed at
    the midpoints of an even split, the index is ``floor(a * scale - offset)``, at most ``last``; a constant
    level has ``scale = 0`` and ``offset = -index``. ``scale`` is shrunk by ``2**-10``, so the estimate is
    the nearest index or the one below it, never above (see ``_nearest``).
    """

    bounds: np.ndarray
    scale: np.ndarray
    offset: np.ndarray
    last: np.ndarray

    def table(self) -> jax.Array:
        """The levels as one ``(4, 9)`` array: bounds (padded with +inf), scale, offset, last."""
        return jnp.asarray(np.stack([np.append(self.bounds, np.inf), self.scale, self.offset, self.last]))


def _levels(values: np.ndarray, decades: int = 7) -> _Levels:
    """The closed form of :func:`dynamic_map`'s ``values`` (either kind), indexing magnitudes from 0 (for 0) up."""
    zero = int(np.searchsorted(values, 0.0))  # the code of 0
    top = len(values) - 1 - zero  # the magnitude index of 1
    per_decade = [2 ** (i + (0 if values[0] < 0 else 1)) for i in range(decades)]
    starts = np.cumsum([1, *per_decade])  # the magnitude index of each decade's first entry, then of 1
    bounds = _midpoints(values)[zero + starts - 1]
    scale = [0.0, *(10.0 ** (decades - 1 - i) / 0.9 * steps * (1 - 2**-10) for i, steps in enumerate(per_decade)), 0.0]
    offset = [0.0, *(steps / 9 - start for steps, start in zip(per_decade, starts[:-1], strict=True)), -top]
    last = [0, *(start + steps - 1 for steps, start in zip(per_decade, starts[:-1], strict=True)), top]
    return _Levels(*(np.asarray(v, np.float32) for v in (bounds, scale, offset, last)))


_SIGNED_LEVELS = _levels(_SIGNED_MAP)
_UNSIGNED_LEVELS = _levels(_UNSIGNED_MAP)
# Both maps' 255 midpoints, signed then unsigned, each between -inf and +inf: a code's neighbouring midpoints.
_MIDPOINTS = np.concatenate(
    [[-np.inf], _midpoints(_SIGNED_MAP), [np.inf, -np.inf], _midpoints(_UNSIGNED_MAP), [np.inf]]
).astype(np.float32)
_UNSIGNED_BASE = 257


def _nearest(x: jax.Array, unsigned: jax.Array) -> jax.Array:
    """The code of the map entry nearest to each element of ``x`` (in [-1, 1]): the same code as a search.

    ``unsigned`` (per block) picks the map. The level of ``|x|`` (zero, a decade, one) is the count of the
    level bounds under it, exact; within a decade, ``floor(|x| * scale - offset)`` is the nearest index or,
    as the scale is shrunk a little, the one toward zero. A single gather of the midpoint on that side and
    one compare settle it, with the search's ties (a value on a midpoint takes the lower code). The old
    binary search took eight dependent gathers per element; this is a few selects, a multiply and one gather.
    """
    magnitude = jnp.abs(x)
    negative = x < 0
    # Per block, its map's levels (bounds, scale, offset, last): selected once per block, not per element.
    levels = jnp.where(unsigned[..., None, None], _UNSIGNED_LEVELS.table(), _SIGNED_LEVELS.table())
    bounds, scales, offsets, lasts = (levels[..., i, :] for i in range(4))
    scale, offset, last = scales[..., 0], offsets[..., 0], lasts[..., 0]
    for k in range(bounds.shape[-1] - 1):
        # A negative value on a bound is above it in magnitude: the search gives it the lower code.
        above = (magnitude > bounds[..., k]) | (negative & (magnitude == bounds[..., k]))
        scale = jnp.where(above, scales[..., k + 1], scale)
        offset = jnp.where(above, offsets[..., k + 1], offset)
        last = jnp.where(above, lasts[..., k + 1], last)
    index = jnp.minimum(jnp.floor(magnitude * scale - offset), last).astype(jnp.int32)
    code = jnp.where(unsigned, index, jnp.clip(jnp.where(negative, 127 - index, 127 + index), 0, 255))
    # Positive values may need the code above (the midpoint above the code is under x), negative ones the
    # code below (the midpoint below it is at or over x).
    midpoint = jnp.asarray(_MIDPOINTS)[jnp.where(unsigned, _UNSIGNED_BASE, 0) + code + jnp.where(negative, 0, 1)]
    code = code + jnp.where(negative, -(midpoint >= x).astype(jnp.int32), (midpoint < x).astype(jnp.int32))
    return code.astype(jnp.uint8)


def quantize_int8(x: jax.Array) -> jax.Array:
    """Blockwise 8-bit codes of float32 ``x`` along its last axis, as uint8 ``(*shape[:-1], packed_width(n))``.

    Each row holds its ``n`` codes, then each block's float32 scale as 4 bytes (negative: a signed
    block). One plain array per leaf, so the codes travel with any framework's state handling, and
    the rows of a leaf's codes are the codes of those rows.
    """
    n = x.shape[-1]
    blocks = _blocks(x)
    # One pass of reductions over x; sqrt is monotone and correctly rounded, so max sqrt(x) is sqrt(max x).
    smallest = jnp.min(blocks, axis=-1, keepdims=True)
    non_negative = smallest >= 0
    largest = jnp.abs(jnp.maximum(jnp.max(blocks, axis=-1, keepdims=True), -smallest))
    absmax = jnp.where(non_negative, jnp.sqrt(largest), largest)
    magnitude = jnp.where(non_negative, jnp.sqrt(jnp.abs(blocks)), blocks)
    normalized = magnitude / jnp.where(absmax > 0, absmax, 1)
    codes = _nearest(normalized, non_negative)
    scales = jnp.where(non_negative, absmax, -absmax)[..., 0]
    scale_bytes = jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(*x.shape[:-1], -1)
    return jnp.concatenate([codes.reshape(*x.shape[:-1], -1)[..., :n], scale_bytes], axis=-1)


def dequantize_int8(packed: jax.Array) -> jax.Array:
    """The float32 values that :func:`quantize_int8`'s ``packed`` codes stand for."""
    n = _unpacked_width(packed.shape[-1])
    codes = _blocks(packed[..., :n].astype(jnp.int32))
    scales = jax.lax.bitcast_convert_type(packed[..., n:].reshape(*packed.shape[:-1], -1, 4), jnp.float32)[..., None]
    # One lookup in both maps (signed, then unsigned), not one per map: XLA materializes each gather.
    entries = jnp.asarray(np.concatenate([_SIGNED_MAP, _UNSIGNED_MAP]))[codes + jnp.where(scales >= 0, 256, 0)]
    values = jnp.where(scales >= 0, (entries * scales) ** 2, entries * -scales)
    return values.reshape(*packed.shape[:-1], -1)[..., :n]


_CODE_DTYPES = {np.dtype(np.uint8): "int8", np.dtype(np.uint16): "bf16"}


def compress(state: Any, codec: str, count: jax.Array, *, stochastic: bool = False) -> Any:
    """``state`` with each :func:`compressible` leaf encoded by ``codec``.

    A compressed leaf is a plain array whose dtype says its codec: uint8 for int8 codes
    (:func:`quantize_int8`), uint16 for bf16 bits. Either decompresses to float32.

    Args:
      state: an optax state tree.
      codec: ``"bf16"`` or ``"int8"``.
      count: the step, which seeds stochastic rounding.
      stochastic: bf16 only: stochastic rounding instead of round to nearest even.
    """

    def one(path: Any, leaf: Any) -> Any:
        if not compressible(leaf):
            return leaf
        if codec == "int8":
            return quantize_int8(leaf)
        seed = zlib.crc32(jax.tree_util.keystr(path).encode())
        rounded = _stochastic_bf16(leaf, count, seed) if stochastic else leaf.astype(jnp.bfloat16)
        return jax.lax.bitcast_convert_type(rounded, jnp.uint16)

    return jax.tree_util.tree_map_with_path(one, state)


def decompress(state: Any) -> Any:
    """The inverse of :func:`compress`: each uint8 or uint16 leaf back in float32."""

    def one(leaf: Any) -> Any:
        codec = _CODE_DTYPES.get(np.dtype(leaf.dtype))
        if codec == "int8":
            return dequantize_int8(leaf)
        if codec == "bf16":
            return jax.lax.bitcast_convert_type(leaf, jnp.bfloat16).astype(jnp.float32)
        return leaf

    return jax.tree_util.tree_map(one, state)


def _check_codable(state: Any) -> None:
    """Refuses an inner state that holds uint8 or uint16 leaves of its own: they would read as codes."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if np.dtype(leaf.dtype) in _CODE_DTYPES:
            raise OffloadError(
                f"quantized_state cannot wrap an optimizer whose state leaf {jax.tree_util.keystr(path)} is "
                f"{np.dtype(leaf.dtype)}: that dtype marks compressed leaves; wrap an optimizer with float state"
            )


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
      stochastic: with ``"bf16"``, round stochastically, reproducibly (random bits from a hash of
        the bits kept, the column, the step and the leaf's path, not a PRNG).

    Returns:
      An optax transformation whose state is a :class:`QuantizedState`.

    Raises:
      OffloadError: for an unknown codec, or ``stochastic`` with ``"int8"``; at ``init``, for an inner
        state with uint8 or uint16 leaves (the dtypes of compressed leaves).
    """
    if codec not in CODECS:
        raise OffloadError(f"quantized_state codec {codec!r} is not one of {CODECS}: pass one of those")
    if stochastic and codec != "bf16":
        raise OffloadError(
            f"stochastic rounding is a bf16 option; codec {codec!r} rounds to the nearest code: pass "
            "stochastic=False, or codec='bf16'"
        )
    inner = optax.with_extra_args_support(inner)

    def init(params: Any) -> QuantizedState:
        count = jnp.zeros([], jnp.int32)
        state = inner.init(params)
        _check_codable(state)
        # Mostly zeros known at trace time: without the barrier XLA constant-folds the encoding of a
        # large zero moment, taking seconds to compile each init program of the int8 codec.
        state = jax.lax.optimization_barrier(state)
        return QuantizedState(count, compress(state, codec, count, stochastic=stochastic))

    def update(updates: Any, state: QuantizedState, params: Any = None, **extra_args: Any) -> tuple:
        count = optax.safe_increment(state.count)
        updates, new_inner = inner.update(updates, decompress(state.inner), params, **extra_args)
        return updates, QuantizedState(count, compress(new_inner, codec, count, stochastic=stochastic))

    return optax.GradientTransformationExtraArgs(init, update)
