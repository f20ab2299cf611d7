"""``state_codecs.py``: quantized_state, compressed moments in memory and offloaded, fewer bytes per update, training
quality.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    LOW_PRECISION_STATE_BOUND,
    abstract,
    assert_close_to_optax,
    assert_same_bits,
    grads_at,
    load_module,
    make_params,
    run_offload,
    run_optax,
    train,
)

import jax_mlp
from jax_mlp._src import state_codecs
from jax_mlp._src.plan import partition
from jax_mlp._src.state_codecs import quantized_state

STEPS = 10
SUBGROUP = "16KiB"
CODECS = {
    "int8": lambda: quantized_state(optax.adam(1e-2), "int8"),
    "bf16_stochastic": lambda: quantized_state(optax.adam(1e-2), "bf16", stochastic=True),
}


def _block_max(x: np.ndarray) -> np.ndarray:
    """Each element's block maximum of |x| (blocks of BLOCK_SIZE along the last axis)."""
    n = x.shape[-1]
    padded = np.pad(np.abs(x), [(0, 0)] * (x.ndim - 1) + [(0, -n % state_codecs.BLOCK_SIZE)])
    blocks = padded.reshape(*x.shape[:-1], -1, state_codecs.BLOCK_SIZE)
    return np.repeat(blocks.max(axis=-1), state_codecs.BLOCK_SIZE, axis=-1)[..., :n]


def _round_trip(x: np.ndarray) -> np.ndarray:
    return np.asarray(state_codecs.dequantize_int8(state_codecs.quantize_int8(jnp.asarray(x, jnp.float32))))


def _old_format(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Packed rows as the dynamic-map codec (int8 format 1) wrote them: the codes, then float32 scales."""
    return np.concatenate([codes, scales.astype(np.float32).view(np.uint8).reshape(len(codes), -1)], axis=1)


def test_int8_signed_values_are_within_half_a_step_and_flush_to_zero_only_below_the_range():
    """Signed blocks: 3 fraction bits (at most 1/16 relative error) over 15.75 binades below the block max."""
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (7, 600)) * jnp.logspace(-10, 2, 600))
    packed = state_codecs.quantize_int8(jnp.asarray(x))
    assert packed.dtype == jnp.uint8 and packed.shape == (7, 600 + 3 * 4)  # per row: codes, then 3 block words
    assert state_codecs.packed_width(600) == 612
    decoded, block_max = _round_trip(x), _block_max(x)
    in_range, below = np.abs(x) >= block_max * 2**-15.5, np.abs(x) < block_max * 2**-16.25
    assert in_range.sum() > 2000 and below.sum() > 50
    assert np.all(np.abs(decoded - x)[in_range] <= np.abs(x)[in_range] / 16)
    assert np.all(np.sign(decoded[in_range]) == np.sign(x[in_range]))
    assert np.all(decoded[below] == 0)
    assert np.all(np.abs(decoded - x) <= np.maximum(np.abs(x) / 16, block_max * 2**-15.5))


def test_int8_second_moment_never_underflows_within_nine_decades_and_keeps_a_bounded_error():
    """Non-negative blocks code sqrt(x) with 4 fraction bits: 9.3 decades of x in one block, none decoded as 0."""
    nu = np.asarray(jnp.logspace(-9.3, 0, 512).reshape(2, 256) * (1 + 0.1 * jnp.sin(jnp.arange(512.0)).reshape(2, 256)))
    decoded = _round_trip(nu)
    assert np.all(decoded > 0)
    relative = np.abs(decoded - nu) / nu
    assert np.all(relative <= (1 + 1 / 32) ** 2 - 1)  # half a step of sqrt(x), squared
    assert np.median(relative) > 0.001, "the codes round: an error bound of 0 would mean nothing was tested"
    far = np.concatenate([nu[1:, :255], [[1e-10]]], axis=1)  # 10 decades below the block max: past the range
    assert _round_trip(far)[0, -1] == 0 and np.all(_round_trip(far)[0, :255] > 0)
    linear = np.round(nu / _block_max(nu) * 255) / 255 * _block_max(nu)
    assert np.mean(linear == 0) > 0.4, "the linear map this replaces zeroes many of them"


def test_int8_codes_are_the_same_eager_and_jitted_and_depend_only_on_the_bits():
    """Integer operations on the bits and a correctly rounded sqrt: no compiled variant can round otherwise."""
    rng = np.random.default_rng(0)
    magnitudes = 10.0 ** rng.uniform(-12, 3, (64, 512))
    # Values on and one ulp either side of the rounding boundaries of the 3- and 4-bit fractions.
    boundary = (np.asarray(magnitudes, np.float32).view(np.uint32) & ~np.uint32(0x7FFFF)) | np.uint32(0x40000)
    boundary = boundary.view(np.float32)
    ties = np.concatenate([boundary, np.nextafter(boundary, 0), np.nextafter(boundary, np.inf)])
    for x in (magnitudes, magnitudes * rng.choice([-1, 1], magnitudes.shape), ties, -ties, ties**2):
        x = jnp.asarray(x, jnp.float32)
        eager = np.asarray(state_codecs.quantize_int8(x))
        assert_same_bits(np.asarray(jax.jit(state_codecs.quantize_int8)(x)), eager)
        fused = jax.jit(lambda x: state_codecs.quantize_int8(x * 2) + state_codecs.quantize_int8(x)[::-1][::-1])(x)
        assert_same_bits(np.asarray(fused), np.asarray(state_codecs.quantize_int8(x * 2)) + eager)
        decoded = np.asarray(state_codecs.dequantize_int8(jnp.asarray(eager)))
        assert_same_bits(np.asarray(jax.jit(state_codecs.dequantize_int8)(jnp.asarray(eager))), decoded)


def test_int8_edge_values():
    """Zeros, -0.0, subnormals, the largest finite values, inf and NaN, and the padding of a partial block."""
    big = np.finfo(np.float32).max
    tiny = np.finfo(np.float32).smallest_subnormal
    assert_same_bits(_round_trip(np.zeros((2, 300))), np.zeros((2, 300), np.float32))  # the last block padded
    signed = np.array([[-0.0, 0.0, -1.0, 2.0, big, -big, 3.0] + [0.5] * 25], np.float32)
    decoded = _round_trip(signed)
    assert np.signbit(decoded[0, 0]) and decoded[0, 1] == 0 and not np.signbit(decoded[0, 1])
    assert np.all(np.isfinite(decoded)) and np.all(np.abs(decoded[0, 4:6] - signed[0, 4:6]) <= big / 16)
    assert np.all(decoded[0, 2:4] == 0), "32 binades below the block max: flushed to zero"
    non_negative = np.array([[-0.0, big, 1e30] + [0.0] * 29], np.float32)
    decoded = _round_trip(non_negative)
    assert decoded[0, 0] == 0 and np.isfinite(decoded[0, 1]) and abs(decoded[0, 1] / big - 1) <= 0.13
    assert abs(decoded[0, 2] / 1e30 - 1) <= 0.07
    # Subnormals stay below the smallest normal (XLA on CPU flushes them to zero in float operations).
    subnormal = np.array([[tiny, 100 * tiny, 2.0**-127, -(2.0**-130), 2.0**-126] + [0.0] * 27], np.float32)
    for x in (subnormal, np.abs(subnormal)):
        decoded = _round_trip(x)
        assert np.all(np.abs(decoded[0, :4]) < 2.0**-126) and decoded[0, 4] == 2.0**-126
    for values in ([np.inf, -1.0, 2.0, np.nan, -np.inf], [np.inf, 1.0, 2.0, np.nan, 0.0]):
        x = np.array([values + [1.0] * 27], np.float32)
        decoded = _round_trip(x)
        assert decoded[0, 0] == np.inf and np.isnan(decoded[0, 3]), "inf and NaN survive"
        assert np.all(decoded[0, 5:] == 0) and not np.any(np.isfinite(decoded[0, 1:3]) & (decoded[0, 1:3] != 0))


def test_int8_state_of_the_old_format_decodes_as_nan_and_is_refused_with_a_clear_error():
    """Old records (dynamic map codes, float32 scales) can never pass as this format's block words."""
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 256, (8, 600)).astype(np.uint8)
    scales = rng.standard_normal((8, 3)) * 10.0 ** rng.uniform(-5, 3, (8, 3))
    scales[0] = [np.inf, -np.inf, -np.nan]  # the scales the old codec wrote for blocks with inf or NaN
    scales[1] = [0.0, 1.0, -1.0]
    old = _old_format(codes, scales)
    assert np.all(np.isnan(np.asarray(state_codecs.dequantize_int8(jnp.asarray(old))))), "never finite garbage"
    with pytest.raises(jax_mlp.OffloadError, match="the nu leaf holds int8 state codes of an older format"):
        state_codecs.check_int8_format(old, "the nu leaf")
    state_codecs.check_int8_format(np.asarray(state_codecs.quantize_int8(jnp.asarray(codes, jnp.float32))), "new codes")


def test_bf16_rounds_to_nearest_even_or_stochastically_without_bias():
    x = jnp.full((4, 4096), 1.0 + 2.0**-9, jnp.float32)  # a quarter of a bf16 ulp above 1
    nearest = state_codecs.compress({"m": x}, "bf16", jnp.int32(3))
    assert nearest["m"].dtype == jnp.uint16  # the bf16 bits
    np.testing.assert_array_equal(np.asarray(state_codecs.decompress(nearest)["m"]), np.asarray(x.astype(jnp.bfloat16)))
    stochastic = state_codecs.compress({"m": x}, "bf16", jnp.int32(3), stochastic=True)
    ups = np.mean(np.asarray(state_codecs.decompress(stochastic)["m"]) > 1.0)
    assert 0.2 < ups < 0.3  # rounded up with probability 1/4
    again = state_codecs.compress({"m": x}, "bf16", jnp.int32(3), stochastic=True)
    next_step = state_codecs.compress({"m": x}, "bf16", jnp.int32(4), stochastic=True)
    assert_same_bits(again, stochastic)
    assert not np.array_equal(np.asarray(next_step["m"]), np.asarray(again["m"])), "each step draws other bits"


@pytest.mark.parametrize("codec,stochastic", [("int8", False), ("bf16", True)])
def test_a_row_chunk_compresses_as_those_rows_of_the_whole_leaf(codec, stochastic):
    x = jax.random.normal(jax.random.PRNGKey(1), (64, 300)) ** 2 * jnp.where(jnp.arange(300) < 200, 1, -1)
    whole = state_codecs.compress({"m": x}, codec, jnp.int32(5), stochastic=stochastic)
    chunk = state_codecs.compress({"m": x[17:40]}, codec, jnp.int32(5), stochastic=stochastic)
    assert_same_bits(chunk, jax.tree.map(lambda a: a[17:40], whole))


def test_what_stays_as_it_is():
    state = quantized_state(optax.adam(1e-2), "int8").init(
        {"w": jnp.ones((8, 32)), "b": jnp.ones(32), "narrow": jnp.ones((64, 8)), "s": jnp.ones(())}
    )
    adam = state.inner[0]
    assert state.count.dtype == jnp.int32 and adam.count.dtype == jnp.int32
    assert adam.mu["w"].dtype == adam.nu["w"].dtype == jnp.uint8
    for name in ("b", "narrow", "s"):  # vectors, a last axis under MIN_LAST_AXIS, scalars
        assert adam.mu[name].dtype == jnp.float32 and adam.nu[name].dtype == jnp.float32
    bf16_state = quantized_state(optax.adam(1e-2, mu_dtype=jnp.bfloat16), "bf16").init({"w": jnp.ones((8, 32))})
    assert bf16_state.inner[0].mu["w"].dtype == jnp.bfloat16, "already bf16: nothing to compress"
    assert bf16_state.inner[0].nu["w"].dtype == jnp.uint16


def test_unknown_codec_stochastic_int8_and_state_in_code_dtypes_are_refused():
    with pytest.raises(jax_mlp.OffloadError, match="fp8"):
        quantized_state(optax.adam(1e-2), "fp8")
    with pytest.raises(jax_mlp.OffloadError, match="stochastic"):
        quantized_state(optax.adam(1e-2), "int8", stochastic=True)
    with pytest.raises(jax_mlp.OffloadError, match=r"\['w'\] is uint8"):
        quantized_state(optax.adam(1e-2, mu_dtype=jnp.uint8), "int8").init({"w": jnp.ones((8, 32))})


def test_works_inside_nnx_optimizer():
    """nnx.Optimizer wraps each state leaf in a Variable: compressed leaves are plain arrays, so they survive."""
    from flax import nnx

    model = nnx.Linear(32, 32, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, quantized_state(optax.adam(1e-2), "int8"), wrt=nnx.Param)
    grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
    before = np.asarray(model.kernel[...])
    for _ in range(3):
        optimizer.update(model, grads)
    assert optimizer.opt_state.inner[0].nu["kernel"][...].dtype == jnp.uint8
    np.testing.assert_allclose(np.asarray(model.kernel[...]), before - 3e-2, atol=1e-3)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_offloaded_equals_in_memory_and_bits_independent_of_tiering(name, paths):
    inner = CODECS[name]()
    params = make_params()
    plan = partition.make_plan(params, inner, jax_mlp.parse_size(SUBGROUP))
    assert len(plan.subgroups) >= 5
    assert any(p.rows is not None for sg in plan.subgroups for p in sg.pieces), "a leaf must be split into rows"
    dtypes = {f.dtype for sg in plan.subgroups for f in sg.layout.state_fields}
    assert np.dtype(np.uint8 if name == "int8" else np.uint16) in dtypes, "records carry the codes"

    reference = run_offload(inner, params, STEPS, [paths[0] / "a"], subgroup_size=SUBGROUP, host_cache=0)[0]
    variants = {
        "part_cache_two_paths": dict(paths=[paths[0] / "b", paths[1] / "b"], host_cache=plan.state_nbytes // 3),
        "reopened": dict(paths=[paths[0] / "c", paths[1] / "c"], host_cache=plan.state_nbytes // 2, reopen_at=5),
    }
    for variant, options in variants.items():
        other = run_offload(inner, params, STEPS, options.pop("paths"), subgroup_size=SUBGROUP, **options)[0]
        assert_same_bits(other, reference, variant)
    for jit in (False, True):
        expected = run_optax(inner, params, STEPS, jit=jit)
        assert_close_to_optax(reference, expected, params, bound=LOW_PRECISION_STATE_BOUND, what=f"jit={jit}")


def _bytes_read_per_param(inner, params, tmp_path, **options) -> tuple[float, float]:
    """Bytes read from the path by the first update with no host cache, and the plan's state bytes, per param."""
    with jax_mlp.mlp_offload(inner, paths=[tmp_path], subgroup_size="256KiB", host_cache=0, **options) as tx:
        state = tx.init(params)
        tx.update(grads_at(params, 0), state, params)  # the first update after init reads every record
        n = sum(x.size for x in jax.tree.leaves(params))
        read, planned = sum(tx.stats.bytes_read.values()) / n, tx.plan.state_nbytes / n
    return read, planned


SCALES = 2 * 4 / state_codecs.BLOCK_SIZE  # two moments, a float32 scale per block


@pytest.mark.parametrize(
    "dtype,master,storage,expected",
    [
        (jnp.float32, None, "remainder", (8, 4, 2 + SCALES)),
        (jnp.bfloat16, jnp.float32, "remainder", (10, 6, 4 + SCALES)),  # the master as its low 16 bits
        (jnp.bfloat16, jnp.float32, "full", (12, 8, 6 + SCALES)),
    ],
)
def test_bytes_moved_per_param_follow_the_codec(dtype, master, storage, expected, tmp_path):
    params = make_params({"a": (512, 256), "b": (256, 512)}, dtype=dtype)
    inners = {"none": optax.adam(1e-3), **{c: quantized_state(optax.adam(1e-3), c) for c in state_codecs.CODECS}}
    for (codec, inner), bound in zip(inners.items(), expected, strict=True):
        read, planned = _bytes_read_per_param(
            inner, params, tmp_path / codec, master_dtype=master, master_storage=storage
        )
        assert bound <= planned <= bound * 1.01, (codec, planned)
        assert planned <= read <= planned * 1.01, (codec, read)  # records' headers and alignment only


def test_int8_adam_trains_a_small_language_model_as_well_as_fp32():
    """300 steps of a tiny LM on Zipf tokens (rare tokens: tiny nu): int8 ends within 5% of fp32."""
    bench = load_module(pathlib.Path(__file__).parents[1] / "benchmarks" / "state_codecs.py")
    fp32 = bench.train(optax.adam(3e-3), 300)[0]
    int8 = bench.train(quantized_state(optax.adam(3e-3), "int8"), 300)[0]
    assert np.all(np.isfinite(int8))
    assert bench.final_loss(fp32) < 0.7 * fp32[0], "the model must learn for the comparison to mean anything"
    assert abs(bench.final_loss(int8) - bench.final_loss(fp32)) <= 0.05 * bench.final_loss(fp32)


def test_a_checkpoint_of_int8_state_restores_into_another_plan_and_into_memory(tmp_path):
    """The packed codes of a split leaf are row ranges, so the standard layout holds them like any moment."""
    import orbax.checkpoint as ocp

    inner = CODECS["int8"]()
    params = make_params()
    like = abstract(params)
    with jax_mlp.mlp_offload(inner, paths=[tmp_path / "a"], subgroup_size=SUBGROUP, host_cache=0) as tx:
        state = tx.init(params)
        params, state = train(tx, params, state, range(5))
        with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
            manager.save(5, args=ocp.args.Composite(opt_state=jax_mlp.OffloadSave(tx)))
        expected, _ = train(tx, params, state, range(5, 10))

    layout = jax_mlp.standard_layout(inner, like)

    def restore(args):
        with ocp.CheckpointManager(tmp_path / "ckpt") as manager:  # a fresh one: orbax binds an item to a handler
            return manager.restore(5, args=ocp.args.Composite(opt_state=args))["opt_state"]

    with jax_mlp.mlp_offload(inner, paths=[tmp_path / "b"], subgroup_size="8KiB") as other:
        restored, plain = restore(jax_mlp.OffloadRestore(other, like)), restore(ocp.args.StandardRestore(layout))
        assert plain.inner[0].nu["big"].dtype == jnp.uint8
        other_plan, _ = train(other, params, restored, range(5, 10))
    in_memory, _ = train(inner, params, plain, range(5, 10))
    for name, result in (("other plan", other_plan), ("in memory", in_memory)):
        assert_close_to_optax(result, expected, bound=LOW_PRECISION_STATE_BOUND, what=name)


def _as_old_format(leaf: jax.Array) -> np.ndarray:
    """An int8-coded leaf as format 1 would have held it: the same codes, float32 scales for block words."""
    packed = np.asarray(leaf)
    n = packed.shape[-1] - 4 * -(-packed.shape[-1] // (state_codecs.BLOCK_SIZE + 4))
    scales = np.ones((*packed.shape[:-1], packed.shape[-1] - n), np.uint8).view(np.float32)
    return np.concatenate([packed[..., :n], scales.view(np.uint8)], axis=-1)


def test_tiers_and_checkpoints_of_the_old_int8_format_are_refused_with_a_clear_error(tmp_path):
    """A run.json from before the block format (no ``int8_format``) is not resumed, and old codes not restored."""
    import json

    import orbax.checkpoint as ocp

    inner, params = CODECS["int8"](), make_params()
    run_offload(inner, params, 2, [tmp_path / "run"], subgroup_size=SUBGROUP)
    (run_file,) = (tmp_path / "run").glob("*/run.json")
    identity = json.loads(run_file.read_text())
    assert identity["int8_format"] == state_codecs.INT8_FORMAT
    run_file.write_text(json.dumps({k: v for k, v in identity.items() if k != "int8_format"}))  # as format 1 wrote it
    with (
        pytest.raises(jax_mlp.OffloadError, match=r"int8 state codes are of format 1.*start a new run"),
        jax_mlp.mlp_offload(inner, paths=[tmp_path / "run"], subgroup_size=SUBGROUP, resume=True) as resumed,
    ):
        resumed.init(params)
    _, state = train(inner, params, inner.init(params), range(2))
    old = jax.tree.map(lambda x: _as_old_format(x) if x.dtype == jnp.uint8 else x, state)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(2, args=ocp.args.Composite(opt_state=ocp.args.StandardSave(old)))
    with (
        jax_mlp.mlp_offload(inner, paths=[tmp_path / "restored"], subgroup_size=SUBGROUP) as tx,
        ocp.CheckpointManager(tmp_path / "ckpt") as manager,
        pytest.raises(jax_mlp.OffloadError, match=r"checkpoint array .*mu.* holds int8 state codes of an older format"),
    ):
        manager.restore(2, args=ocp.args.Composite(opt_state=jax_mlp.OffloadRestore(tx, abstract(params))))
