"""quantized_state: compressed moments in memory and offloaded, fewer bytes per update, training quality."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import grads_at, make_params, run_offload, run_optax
from helpers import LOW_PRECISION_STATE_BOUND, assert_close_to_optax, assert_same_bits, load_module

import jax_mlp
from jax_mlp import quantized
from jax_mlp.quantized import quantized_state

STEPS = 10
SUBGROUP = "16KiB"
CODECS = {
    "int8": lambda: quantized_state(optax.adam(1e-2), "int8"),
    "bf16_stochastic": lambda: quantized_state(optax.adam(1e-2), "bf16", stochastic=True),
}


def _block_max(x: np.ndarray) -> np.ndarray:
    """Each element's block maximum of |x| (blocks of BLOCK_SIZE along the last axis)."""
    n = x.shape[-1]
    padded = np.pad(np.abs(x), [(0, 0)] * (x.ndim - 1) + [(0, -n % quantized.BLOCK_SIZE)])
    blocks = padded.reshape(*x.shape[:-1], -1, quantized.BLOCK_SIZE)
    return np.repeat(blocks.max(axis=-1), quantized.BLOCK_SIZE, axis=-1)[..., :n]


def test_int8_signed_values_are_within_a_code_step_of_the_block_max():
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (7, 600)) * jnp.logspace(-3, 2, 600))
    packed = quantized.quantize_int8(jnp.asarray(x))
    assert packed.dtype == jnp.uint8 and packed.shape == (7, 600 + 3 * 4)  # per row: codes, then 3 scales
    assert quantized.packed_width(600) == 612
    error = np.abs(np.asarray(quantized.dequantize_int8(packed)) - x)
    assert np.all(error <= 0.008 * _block_max(x))


def test_int8_second_moment_never_underflows_and_keeps_its_top_decades_precise():
    """Non-negative blocks quantize sqrt: 12 decades of nu in one block, none decoded as zero."""
    nu = np.asarray(jnp.logspace(-12, 0, 512).reshape(2, 256) * (1 + 0.1 * jnp.sin(jnp.arange(512.0)).reshape(2, 256)))
    decoded = np.asarray(quantized.dequantize_int8(quantized.quantize_int8(jnp.asarray(nu))))
    assert np.all(decoded > 0)
    relative = np.abs(decoded - nu) / nu
    top = nu >= 1e-2 * _block_max(nu)
    assert top.sum() > 50 and np.all(relative[top] <= 0.08)
    assert np.all(relative <= 1.5)  # even the lowest decades stay within a factor of 2.5
    linear = np.round(nu / _block_max(nu) * 255) / 255 * _block_max(nu)
    assert np.mean(linear == 0) > 0.5, "the linear map this replaces zeroes most of them"


def _map_inputs(values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Values in the map's range: log-uniform over nine decades, uniform, every entry and midpoint with its
    float32 neighbours (the ties and the edges of each decade), 0, -0, the smallest floats and 1."""
    signed = values[0] < 0
    midpoints = quantized._midpoints(values)
    edges = np.concatenate([values, midpoints, np.nextafter(midpoints, np.float32(2)), np.nextafter(midpoints, -2)])
    magnitudes = np.concatenate([10.0 ** rng.uniform(-9, 0, 1 << 18), rng.uniform(0, 1, 1 << 16), [1e-30, 1e-45]])
    x = np.concatenate([magnitudes * (rng.choice([-1, 1], magnitudes.size) if signed else 1), edges, [0, -0.0, 1]])
    x = np.concatenate([x, -x]) if signed else x
    return x[(np.abs(x) <= 1) & (signed | (x >= 0))].astype(np.float32)


@pytest.mark.parametrize("signed", [True, False])
def test_int8_lookup_codes_are_the_nearest_entry_as_a_search_finds_it(signed):
    """The bucket lookup keeps the map and its codes: each is the count of midpoints under x, ties included."""
    values = quantized.dynamic_map(signed=signed)
    x = _map_inputs(values, np.random.default_rng(0))
    expected = np.searchsorted(quantized._midpoints(values), x, side="left")  # the old search's definition
    codes = np.asarray(quantized._nearest(jnp.asarray(x), jnp.full(x.shape, not signed)))
    np.testing.assert_array_equal(codes, expected)


def test_int8_codes_decode_to_the_map_entries_so_old_records_read_the_same():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 256, (8, 600)).astype(np.uint8)
    scales = (rng.standard_normal((8, 3)) * 10.0 ** rng.uniform(-5, 3, (8, 3))).astype(np.float32)
    packed = np.concatenate([codes, scales.view(np.uint8).reshape(8, 12)], axis=1)
    s = np.repeat(scales, quantized.BLOCK_SIZE, axis=-1)[:, :600]
    unsigned = (quantized.dynamic_map(signed=False)[codes] * s) ** 2
    expected = np.where(s >= 0, unsigned, quantized.dynamic_map(signed=True)[codes] * -s)
    np.testing.assert_array_equal(np.asarray(quantized.dequantize_int8(jnp.asarray(packed))), expected)


def test_bf16_rounds_to_nearest_even_or_stochastically_without_bias():
    x = jnp.full((4, 4096), 1.0 + 2.0**-9, jnp.float32)  # a quarter of a bf16 ulp above 1
    nearest = quantized.compress({"m": x}, "bf16", jnp.int32(3))
    assert nearest["m"].dtype == jnp.uint16  # the bf16 bits
    np.testing.assert_array_equal(np.asarray(quantized.decompress(nearest)["m"]), np.asarray(x.astype(jnp.bfloat16)))
    stochastic = quantized.compress({"m": x}, "bf16", jnp.int32(3), stochastic=True)
    ups = np.mean(np.asarray(quantized.decompress(stochastic)["m"]) > 1.0)
    assert 0.2 < ups < 0.3  # rounded up with probability 1/4
    again = quantized.compress({"m": x}, "bf16", jnp.int32(3), stochastic=True)
    next_step = quantized.compress({"m": x}, "bf16", jnp.int32(4), stochastic=True)
    assert_same_bits(again, stochastic)
    assert not np.array_equal(np.asarray(next_step["m"]), np.asarray(again["m"])), "each step draws other bits"


@pytest.mark.parametrize("codec,stochastic", [("int8", False), ("bf16", True)])
def test_a_row_chunk_compresses_as_those_rows_of_the_whole_leaf(codec, stochastic):
    x = jax.random.normal(jax.random.PRNGKey(1), (64, 300)) ** 2 * jnp.where(jnp.arange(300) < 200, 1, -1)
    whole = quantized.compress({"m": x}, codec, jnp.int32(5), stochastic=stochastic)
    chunk = quantized.compress({"m": x[17:40]}, codec, jnp.int32(5), stochastic=stochastic)
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
    plan = jax_mlp.partition.make_plan(params, inner, jax_mlp.parse_size(SUBGROUP))
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
    """Bytes read from the path by one update with no host cache, and the plan's state bytes, per param."""
    tx = jax_mlp.mlp_offload(inner, paths=[tmp_path], subgroup_size="256KiB", host_cache=0, **options)
    state = tx.init(params)
    for step in range(2):
        _, state = tx.update(grads_at(params, step), state, params)
    n = sum(x.size for x in jax.tree.leaves(params))
    read, planned = sum(tx.stats.bytes_read.values()) / n, tx.offloader.plan.state_nbytes / n
    tx.close()
    return read, planned


SCALES = 2 * 4 / quantized.BLOCK_SIZE  # two moments, a float32 scale per block


@pytest.mark.parametrize(
    "dtype,master,expected",
    [(jnp.float32, None, (8, 4, 2 + SCALES)), (jnp.bfloat16, jnp.float32, (12, 8, 6 + SCALES))],
)
def test_bytes_moved_per_param_follow_the_codec(dtype, master, expected, tmp_path):
    params = make_params({"a": (512, 256), "b": (256, 512)}, dtype=dtype)
    inners = {"none": optax.adam(1e-3), **{c: quantized_state(optax.adam(1e-3), c) for c in quantized.CODECS}}
    for (codec, inner), bound in zip(inners.items(), expected, strict=True):
        read, planned = _bytes_read_per_param(inner, params, tmp_path / codec, master_dtype=master)
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
    from conftest import abstract, train

    inner = CODECS["int8"]()
    params = make_params()
    like = abstract(params)
    tx = jax_mlp.mlp_offload(inner, paths=[tmp_path / "a"], subgroup_size=SUBGROUP, host_cache=0)
    state = tx.init(params)
    params, state = train(tx, params, state, range(5))
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(5, args=ocp.args.Composite(opt_state=jax_mlp.OffloadSave(tx)))
    expected, _ = train(tx, params, state, range(5, 10))
    tx.close()

    other = jax_mlp.mlp_offload(inner, paths=[tmp_path / "b"], subgroup_size="8KiB")
    layout = jax_mlp.standard_layout(inner, like)

    def restore(args):
        with ocp.CheckpointManager(tmp_path / "ckpt") as manager:  # a fresh one: orbax binds an item to a handler
            return manager.restore(5, args=ocp.args.Composite(opt_state=args))["opt_state"]

    restored, plain = restore(jax_mlp.OffloadRestore(other, like)), restore(ocp.args.StandardRestore(layout))
    assert plain.inner[0].nu["big"].dtype == jnp.uint8
    other_plan, _ = train(other, params, restored, range(5, 10))
    other.close()
    in_memory, _ = train(inner, params, plain, range(5, 10))
    for name, result in (("other plan", other_plan), ("in memory", in_memory)):
        assert_close_to_optax(result, expected, bound=LOW_PRECISION_STATE_BOUND, what=name)
