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
- ``"int8"``: blocks of ``BLOCK_SIZE`` along the last axis in block floating point (as OCP microscaling
  formats share a block exponent), each block's 4-byte word kept at the end of its row. Coded with
  integer operations on the float32 bits (no table, gather or division), so codes depend only on the
  input bits, the same eager or jitted. A value's magnitude bits are rounded (half up) to a few
  fraction bits; its code is that "prefix" less the block's base, 0 (decoding to 0) at or below it.
  A block that holds a negative value codes sign and 7 bits of magnitude (3 fraction bits: 15.75
  binades under the block max, within 1/16); a non-negative block (adam's ``nu``) codes ``sqrt(x)``
  with 8 bits (4 fraction bits: 31.9 binades, 9.6 decades, of ``x``), so small ``nu`` never
  underflows to zero, as a linear absmax map's does (measured in ``benchmarks/state_codecs.py``;
  docs/concepts.md has the numbers). inf and NaN decode as themselves. The block word is a positive
  NaN carrying a format tag, which no float32 scale of the older dynamic-map format can be.
"""

from __future__ import annotations

import zlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_mlp._src.errors import OffloadError

CODECS = ("bf16", "int8")
BLOCK_SIZE = 256
MIN_LAST_AXIS = 16


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
    """The last axis of an int8-coded row of ``n`` values: ``n`` codes, then each block's 4-byte word."""
    return n + 4 * -(-n // BLOCK_SIZE)


def stored_fraction(codec: str) -> float:
    """Bytes a codec keeps per byte of float32 state, for large leaves: ``"none"``, ``"bf16"`` or ``"int8"``."""
    return {"none": 1.0, "bf16": 0.5, "int8": (1 + 4 / BLOCK_SIZE) / 4}[codec]


def _unpacked_width(width: int) -> int:
    # packed_width is strictly increasing, and its inverse is this: the block count is ceil(width / (B + 4)).
    return width - 4 * -(-width // (BLOCK_SIZE + 4))


GOLDEN = np.uint32(0x9E3779B9)
"""2^32 over the golden ratio: spreads consecutive integers (a counter, a position) over 32 bits before a hash."""


def mix32(x: jax.Array) -> jax.Array:
    """A 32-bit integer hash with good avalanche (the "lowbias32" finaliser), a bijection of ``uint32``.

    It makes stochastic rounding's noise here and the overlap's fingerprints of grads
    (:mod:`jax_mlp._src.stream.arrivals`).
    """
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
    salt = mix32(count.astype(jnp.uint32) * GOLDEN ^ np.uint32(seed))
    noise = mix32(mix32((bits >> 16) ^ salt) + column) & np.uint32(0xFFFF)
    rounded = jax.lax.bitcast_convert_type((bits + noise) & np.uint32(0xFFFF0000), jnp.float32)
    return jnp.where(jnp.isfinite(x), rounded, x).astype(jnp.bfloat16)


def _blocks(x: jax.Array) -> jax.Array:
    """``x`` as ``(*shape[:-1], blocks, BLOCK_SIZE)``, the last axis padded with zeros."""
    n = x.shape[-1]
    blocks = -(-n // BLOCK_SIZE)
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, blocks * BLOCK_SIZE - n)])
    return padded.reshape(*x.shape[:-1], blocks, BLOCK_SIZE)


# The int8 format: block floating point on the float32 bits (see the module docstring). A value's "prefix" is
# its magnitude bits rounded, half up, to ``mantissa`` fraction bits: ``(m + half) >> shift``, 8 exponent bits
# then the fraction, ordered as the magnitudes are. A block's word holds ``base``, the prefix its code 0 stands
# below; a code is ``prefix - base`` (0 when not above it, which decodes to 0).
class _Format(NamedTuple):
    """One kind of block: the fraction bits kept, the highest magnitude code, and the largest finite prefix."""

    mantissa: int
    top_code: int
    largest: int  # the largest prefix a finite value takes: decoding it (and squaring, unsigned) stays finite

    @property
    def shift(self) -> int:
        return 23 - self.mantissa

    def clamp(self) -> int:
        """The largest magnitude bits that round to ``largest``: finite values above it would round to inf."""
        return (self.largest << self.shift) + (1 << (self.shift - 1)) - 1


def _largest_prefix(mantissa: int, square: bool) -> int:
    """The largest prefix whose value (squared when ``square``) is finite in float32."""
    top = (0xFF << mantissa) - 1
    while square and float(np.uint32(top << (23 - mantissa)).view(np.float32)) ** 2 > float(np.finfo(np.float32).max):
        top -= 1
    return top


# A block holding a negative value: a sign bit and 7 magnitude bits, 3 fraction bits (127 prefixes, 15.75 binades
# below the block max, steps of 1/8 of a binade: at most 1/16 relative error, half a step). A non-negative block
# (adam's nu) codes sqrt(x) with all 8 bits, 4 fraction bits: 255 prefixes, 15.9 binades of sqrt(x), so 31.9
# binades (9.6 decades) of x, within 1/32 on sqrt(x).
_SIGNED = _Format(3, 0x7F, _largest_prefix(3, square=False))
_UNSIGNED = _Format(4, 0xFF, _largest_prefix(4, square=True))
_INF = 0x7F800000
_QUIET_NAN = 0x7FC00000
# The block word: a quiet NaN whose fraction starts with this tag, then the signed flag (bit 12), then base.
# A float32 scale of the old format (before INT8_FORMAT 2) is finite, +-inf or a negative NaN: never a positive
# NaN, so a word of the old format is never read as one of this format.
_TAG = 0x7F800000 | 0x3A5 << 13
_TAG_MASK = 0xFFFFE000
_SIGNED_FLAG = 1 << 12
_BASE_MASK = _SIGNED_FLAG - 1
INT8_FORMAT = 2
"""The version of the int8 codes' layout, recorded in ``run.json``: 1 was the dynamic map with float32 scales."""


def _u32(value: int) -> np.uint32:
    return np.uint32(value)


def _prefix(m: jax.Array, signed: jax.Array) -> jax.Array:
    """The prefix of magnitude bits ``m`` (uint32) in the block's format; inf and NaN keep their own prefixes.

    Monotone in ``m``, so the prefix of a block's largest magnitude is the block's largest prefix.
    """

    def pick(if_signed: int, if_unsigned: int) -> jax.Array:
        return jnp.where(signed, _u32(if_signed), _u32(if_unsigned))

    shift = pick(_SIGNED.shift, _UNSIGNED.shift)
    rounded = (jnp.minimum(m, pick(_SIGNED.clamp(), _UNSIGNED.clamp())) + (_u32(1) << (shift - 1))) >> shift
    special = jnp.where(m > _u32(_INF), _u32(_QUIET_NAN), _u32(_INF)) >> shift  # inf, or NaN as the quiet NaN
    return jnp.where(m >= _u32(_INF), special, rounded)


def quantize_int8(x: jax.Array) -> jax.Array:
    """Blockwise 8-bit codes of float32 ``x`` along its last axis, as uint8 ``(*shape[:-1], packed_width(n))``.

    Each row holds its ``n`` codes, then each block's 4-byte word. Integer operations on the float32 bits
    (and a correctly rounded ``sqrt``), so the codes depend only on the bits of ``x``: eager and jitted
    encodings agree, and the rows of a leaf's codes are the codes of those rows.
    """
    n = x.shape[-1]
    blocks = _blocks(x)
    bits = jax.lax.bitcast_convert_type(blocks, jnp.uint32)
    # Float reductions (XLA vectorizes them; not its unsigned ones). NaN propagates through min and max, so a
    # block with a NaN is coded as non-negative, and its NaN, or any negative value's sqrt, decodes as NaN.
    signed = jnp.min(blocks, axis=-1, keepdims=True) < 0  # a negative value, -0.0 aside
    largest = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    # sqrt is monotone, so the largest sqrt(x) of a non-negative block is sqrt of its largest x.
    largest = jax.lax.bitcast_convert_type(jnp.where(signed, largest, jnp.sqrt(largest)), jnp.uint32)
    top = _prefix(largest, signed)
    base = jnp.maximum(top.astype(jnp.int32) - jnp.where(signed, _SIGNED.top_code, _UNSIGNED.top_code), 0)
    root = jax.lax.bitcast_convert_type(jnp.sqrt(blocks), jnp.uint32)
    magnitude = _prefix(jnp.where(signed, bits, root) & _u32(0x7FFFFFFF), signed).astype(jnp.int32)
    code = jnp.maximum(magnitude - base, 0).astype(jnp.uint32)
    code = code | jnp.where(signed, (bits >> 31) << 7, _u32(0))
    word = (_u32(_TAG) | jnp.where(signed, _u32(_SIGNED_FLAG), _u32(0)) | base.astype(jnp.uint32))[..., 0]
    word_bytes = jax.lax.bitcast_convert_type(word, jnp.uint8).reshape(*x.shape[:-1], -1)
    return jnp.concatenate([code.astype(jnp.uint8).reshape(*x.shape[:-1], -1)[..., :n], word_bytes], axis=-1)


def dequantize_int8(packed: jax.Array) -> jax.Array:
    """The float32 values that :func:`quantize_int8`'s ``packed`` codes stand for.

    A block whose word is not of this format (a record of the old int8 format) decodes as NaN, never as
    finite values; ``run.json`` and checkpoint restore refuse such state before it gets here.
    """
    n = _unpacked_width(packed.shape[-1])
    codes = _blocks(packed[..., :n]).astype(jnp.uint32)
    word = jax.lax.bitcast_convert_type(packed[..., n:].reshape(*packed.shape[:-1], -1, 4), jnp.uint32)[..., None]
    signed = (word & _u32(_SIGNED_FLAG)) != 0
    magnitude = jnp.where(signed, codes & _u32(0x7F), codes)
    shift = jnp.where(signed, _u32(_SIGNED.shift), _u32(_UNSIGNED.shift))
    value_bits = jnp.where(magnitude == 0, _u32(0), (magnitude + (word & _u32(_BASE_MASK))) << shift)
    value = jax.lax.bitcast_convert_type(value_bits | jnp.where(signed, (codes >> 7) << 31, _u32(0)), jnp.float32)
    value = jnp.where(signed, value, value * value)
    value = jnp.where((word & _u32(_TAG_MASK)) == _u32(_TAG), value, jnp.float32(jnp.nan))
    return value.reshape(*packed.shape[:-1], -1)[..., :n]


def int8_codes(state: Any) -> list[bool]:
    """Per leaf of ``state`` (arrays or shape-dtype structs), whether it holds a :class:`QuantizedState`'s int8 codes."""

    def marks(node: Any) -> Any:
        coded = isinstance(node, QuantizedState)
        return jax.tree.map(lambda leaf: coded and np.dtype(leaf.dtype) == np.uint8, node)

    return jax.tree.leaves(jax.tree.map(marks, state, is_leaf=lambda node: isinstance(node, QuantizedState)))


def check_int8_format(packed: np.ndarray, what: str) -> None:
    """Refuses int8 codes (a host array of :func:`quantize_int8`'s layout) whose block words are not this format's.

    Raises:
      OffloadError: naming ``what``, for codes of the old format (dynamic map, float32 scales).
    """
    n = _unpacked_width(packed.shape[-1])
    words = np.ascontiguousarray(packed[..., n:]).view(np.uint32)
    if np.any(words & _u32(_TAG_MASK) != _u32(_TAG)):
        raise OffloadError(
            f"{what} holds int8 state codes of an older format than this version's (format {INT8_FORMAT}: block "
            "floating point), which it cannot read: restore the params alone and start the optimizer state anew, "
            "or keep the jax_mlp version that wrote them for that run"
        )


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
      codec: ``"bf16"`` (round to nearest even) or ``"int8"`` (blocks of 256 along the last axis in
        block floating point, ``sqrt`` for non-negative blocks).
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
