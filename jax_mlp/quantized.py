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
  found by one lookup and one compare (``_nearest``: a table indexed by the value's top 16 bits). A block that holds a negative value uses
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


def _ordered(bits: Any) -> Any:
    """float32 bits (numpy or jax uint32) as keys that order as the floats do: negatives reversed, below positives."""
    return ((bits >> 31) * np.uint32(0xFFFFFFFF)) ^ (bits | np.uint32(0x80000000))


# A value's code is the count of its map's midpoints below it. The top 16 bits of its ordered key name a
# bucket of 2**16 floats, no wider than 2**-7 of its values; a map's finest step (0.9 / 128, at the top of the
# unsigned map) is wider than any bucket under 1 (2**-8), so a bucket holds at most one midpoint. Per bucket
# the table holds the count of midpoints below it and the low 16 key bits of the next midpoint if it lies in
# the bucket (else 0xFFFF, never exceeded): one lookup and one compare give the exact count, ties included.
_BUCKETS = 1 << 16


def _bucket_table(values: np.ndarray) -> np.ndarray:
    """Per bucket of keys, ``below | threshold << 8`` for the map ``values`` (see above)."""
    keys = _ordered(_midpoints(values).astype(np.float32).view(np.uint32))
    starts = np.arange(_BUCKETS, dtype=np.uint32) << 16
    below = np.searchsorted(keys, starts, side="left")
    if np.any(np.searchsorted(keys, starts | np.uint32(0xFFFF), side="right") - below > 1):
        raise OffloadError("a bucket of 2**16 floats holds two midpoints of the int8 map: the lookup needs one")
    following = keys[np.minimum(below, len(keys) - 1)]
    inside = (below < len(keys)) & ((following >> 16) == np.arange(_BUCKETS))
    threshold = np.where(inside, following & np.uint32(0xFFFF), np.uint32(0xFFFF))
    return (below.astype(np.uint32) | threshold << 8).astype(np.uint32)


# The signed map's buckets, then the unsigned map's: one gather finds either.
_BUCKET_TABLE = np.concatenate([_bucket_table(_SIGNED_MAP), _bucket_table(_UNSIGNED_MAP)])


def _nearest(x: jax.Array, unsigned: jax.Array) -> jax.Array:
    """The code of the map entry nearest to each element of ``x`` (in [-1, 1]), exactly as a search finds it.

    ``unsigned`` (broadcast against ``x``) picks the map. One gather of the table entry for ``x``'s bucket
    and one compare with the midpoint in it, with the search's ties (a value on a midpoint takes the lower
    code); the binary search this replaced took eight dependent gathers per element. A NaN (from an inf in
    its block) takes code 255, or 0 when its sign bit is set.
    """
    key = _ordered(jax.lax.bitcast_convert_type(x, jnp.uint32))
    index = (key >> 16) + jnp.where(unsigned, np.uint32(_BUCKETS), np.uint32(0))
    entry = jnp.asarray(_BUCKET_TABLE).at[index].get(mode="promise_in_bounds")
    above = (key & np.uint32(0xFFFF)) > (entry >> 8)
    return ((entry & np.uint32(0xFF)) + above.astype(jnp.uint32)).astype(jnp.uint8)


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
    codes = _nearest(magnitude / jnp.where(absmax > 0, absmax, 1), non_negative)
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

    def encode(new_inner: Any, count: jax.Array) -> Any:
        return compress(new_inner, codec, count, stochastic=stochastic)

    def update(updates: Any, state: QuantizedState, params: Any = None, **extra_args: Any) -> tuple:
        count = optax.safe_increment(state.count)
        updates, new_inner = inner.update(updates, decompress(state.inner), params, **extra_args)
        if codec == "int8" and jax.default_backend() == "cpu":
            # Encoded in a branch of its own (both branches alike): XLA then encodes the stored new state in
            # vectorised loops, where fused with the update it recomputed the update inside the scalar loop
            # of the encoding's lookup, at 2-3x the update's cost. On accelerators the lookup is cheap and a
            # conditional costs a synchronisation, so there the encoding stays fused.
            return updates, QuantizedState(count, jax.lax.cond(count > 0, encode, encode, new_inner, count))
        return updates, QuantizedState(count, encode(new_inner, count))

    return optax.GradientTransformationExtraArgs(init, update)
