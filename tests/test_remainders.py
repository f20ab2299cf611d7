"""``plan/remainders.py``: fp32 masters stored as bf16 params plus int16 remainders: the bit arithmetic, then the
offload that uses it.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    assert_bf16_bound,
    assert_same_bits,
    bf16_distance,
    decay_mask,
    grads_at,
    load_module,
    make_params,
    train,
)

import jax_mlp
from jax_mlp._src.plan import remainders

WORDS = np.arange(1 << 16, dtype=np.uint16)  # every bf16 word


def _f32(bits) -> np.ndarray:
    return np.asarray(bits, np.uint32).view(np.float32)


def _bf16(words) -> jax.Array:
    return jnp.asarray(np.asarray(words, np.uint16).view(jnp.bfloat16))


def _u32(x) -> np.ndarray:
    return np.asarray(x).view(np.uint32)


def _u16(x) -> np.ndarray:
    return np.asarray(x).view(np.uint16)


EDGES = np.array(
    [
        0x00000000,  # +0
        0x80000000,  # -0
        0x00000001,  # the smallest subnormal
        0x80000001,
        0x00007FFF,  # a subnormal below the first bf16 subnormal, rounded down
        0x00008000,  # a tie, rounded up to the smallest bf16 subnormal
        0x8000FFFF,
        0x007FFFFF,  # the largest subnormal
        0x00800000,  # the smallest normal
        0x3F808000,  # a tie between 1.0078125 (odd word) and 1.015625: RNE also rounds up
        0x3F818000,  # a tie above an odd word... and one above an even word, where RNE rounds down:
        0x3F800000 | 0x8000,
        0xBF808000,  # negative ties round up in magnitude
        0x3F80FFFF,
        0x7F7F0000,  # the largest bf16
        0x7F7F7FFF,
        0x7F7F8000,  # rounds up to inf: the remainder still gives it back
        0x7F7FFFFF,  # the largest fp32
        0xFF7FFFFF,
        0x7F800000,  # inf
        0xFF800000,  # -inf
        0x7FC00000,  # a quiet NaN
        0xFFC00001,
        0x7F800001,  # a NaN whose high half reads as inf
        0x7FFFFFFF,  # a NaN whose rounding would carry into the sign
        0xFFFFFFFF,
    ],
    np.uint32,
)


def _masters() -> np.ndarray:
    random = np.random.default_rng(0).integers(0, 1 << 32, size=1 << 18, dtype=np.uint64).astype(np.uint32)
    return _f32(np.concatenate([EDGES, random]))


def test_split_rounds_half_up_on_the_magnitude_and_rebuild_gives_the_master_back():
    masters = _masters()
    bits = _u32(masters)
    params, remainder = remainders.split(jnp.asarray(masters))
    assert params.dtype == jnp.bfloat16 and remainder.dtype == jnp.int16
    finite = (bits & 0x7F800000) != 0x7F800000
    expected_words = ((bits.astype(np.uint64) + 0x8000) >> 16).astype(np.uint16)  # half up, on the magnitude
    np.testing.assert_array_equal(_u16(params)[finite], expected_words[finite])
    # RNE (astype) agrees except on ties below an even word, which it rounds down: one ulp apart.
    rne = _u16(jnp.asarray(masters).astype(jnp.bfloat16))
    differs = finite & (_u16(params) != rne)
    assert np.all((bits[differs] & 0xFFFF) == 0x8000) and np.all(_u16(params)[differs] - rne[differs] == 1)
    assert np.any(differs)

    rebuilt = np.asarray(remainders.rebuild(params, remainder))
    nan = np.isnan(masters)
    np.testing.assert_array_equal(_u32(rebuilt)[~nan], bits[~nan])  # every finite master and ±inf, bit for bit
    assert np.all(np.isnan(rebuilt[nan])) and np.array_equal(np.signbit(rebuilt[nan]), np.signbit(masters[nan]))
    # The params of a non-finite master are non-finite alike: inf stays inf, NaN stays NaN, with its sign.
    words = np.asarray(params, np.float32)
    assert np.all(np.isnan(words[nan])) and np.array_equal(np.signbit(words[nan]), np.signbit(masters[nan]))
    infinite = np.isinf(masters)
    np.testing.assert_array_equal(words[infinite], masters[infinite])


def test_edge_cases_named():
    cases = {
        "+0": (0x00000000, 0x0000, 0),
        "-0": (0x80000000, 0x8000, 0),
        "subnormal rounded down": (0x00007FFF, 0x0000, 0x7FFF),
        "subnormal tie rounded up": (0x00008000, 0x0001, -0x8000),
        "tie above an even word": (0x3F808000, 0x3F81, -0x8000),
        "negative tie": (0xBF808000, 0xBF81, -0x8000),
        "largest bf16": (0x7F7F0000, 0x7F7F, 0),
        "largest fp32 rounds to inf": (0x7F7FFFFF, 0x7F80, -1),
        "-largest fp32": (0xFF7FFFFF, 0xFF80, -1),
        "inf": (0x7F800000, 0x7F80, 0),
        "-inf": (0xFF800000, 0xFF80, 0),
        "NaN reading as inf": (0x7F800001, 0x7FC0, 0),
        "NaN carrying into the sign": (0x7FFFFFFF, 0x7FFF, 0),
        "-NaN carrying into the sign": (0xFFFFFFFF, 0xFFFF, 0),
    }
    for name, (master, word, remainder) in cases.items():
        params, rem = remainders.split(jnp.asarray(_f32([master])))
        assert (int(_u16(params)[0]), int(rem[0])) == (word, remainder), name


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # NaN and inf on purpose
def test_rebuild_follows_any_params():
    """For every bf16 word and remainder, the rebuilt master splits back into that word: params the
    user set are what the next update starts from, within half a bf16 ulp."""
    rems = np.concatenate([[0, 1, -1, 0x7FFF, -0x8000], np.random.default_rng(1).integers(-0x8000, 0x8000, 27)])
    params = _bf16(np.repeat(WORDS, len(rems)))
    rem = jnp.asarray(np.tile(rems, len(WORDS)).astype(np.int16))
    masters = remainders.rebuild(params, rem)
    words, _ = remainders.split(masters)
    np.testing.assert_array_equal(_u16(words), _u16(params))
    finite = np.isfinite(np.asarray(params, np.float32))
    ulp = np.abs(np.asarray(params, np.float64)[finite]) * 2.0**-7 + 2.0**-133
    assert np.all(np.abs(np.asarray(masters, np.float64)[finite] - np.asarray(params, np.float64)[finite]) <= ulp)


def _landed(params: jax.Array, new: jax.Array) -> np.ndarray:
    return _u16(optax.apply_updates(params, remainders.landing_update(params, new)))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # NaN and inf on purpose
def test_landing_update_lands_exactly_where_an_fp32_addition_can():
    edges = _bf16(
        [0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x3F80, 0xBF80, 0x3F81, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80]
    )
    sample = _bf16(np.random.default_rng(2).choice(WORDS, 192, replace=False))
    news = jnp.concatenate([edges, sample])
    params = _bf16(WORDS)[None, :]
    landed = _landed(params, news[:, None])
    want = np.broadcast_to(_u16(news)[:, None], landed.shape)
    p = np.broadcast_to(np.asarray(params, np.float64), landed.shape)
    n = np.broadcast_to(np.asarray(news, np.float64)[:, None], landed.shape)
    tiny = float(jnp.finfo(jnp.float32).tiny)
    # XLA flushes subnormals in fp32 arithmetic (CPU and GPU alike), so no addition keeps or makes one.
    normal = (np.abs(p) >= tiny) | (p == 0)
    subnormal_new = (np.abs(n) < tiny) & (n != 0)
    finite = np.isfinite(p) & np.isfinite(n) & normal & ~subnormal_new
    exact = landed == want
    # Unchanged words land exactly, infinities and signed zeros included (u = -0.0).
    np.testing.assert_array_equal(exact[(_u16(news)[:, None] == _u16(params)) & normal], True)
    # Finite to finite: exact wherever the new value is at least 2^-15 of the old one in magnitude and
    # the step is a normal fp32 number; +0 never becomes -0 (-0 + u is -0 only for u = -0).
    with np.errstate(invalid="ignore", over="ignore"):
        step = np.abs(n - p)
    near = finite & (np.abs(n) >= np.abs(p) * 2.0**-15) & (step >= tiny) & (step <= float(jnp.finfo(jnp.float32).max))
    assert np.all(exact[near]), (p[near & ~exact][:5], n[near & ~exact][:5])
    # A finite param made NaN or inf lands too.
    nan_or_inf = np.isfinite(p) & normal & ~np.isfinite(n)
    assert np.all(np.isinf(n[nan_or_inf]) <= exact[nan_or_inf])
    # What no addition can do: a tiny new value after a huge one is off by far below one ulp of the old.
    far = finite & (np.abs(n) < np.abs(p) * 2.0**-15) & (n != 0)
    assert np.any(far & ~exact)
    landed_f = np.asarray(landed.view(jnp.bfloat16), np.float64)
    assert np.all(np.abs(landed_f - n)[far] <= np.abs(p[far]) * 2.0**-15)


def test_stored_master_dtype():
    f32, bf16 = np.dtype(np.float32), np.dtype(jnp.bfloat16)
    assert remainders.stored_master_dtype(bf16, f32, "remainder") == np.int16
    assert remainders.stored_master_dtype(bf16, f32, "full") == f32
    assert remainders.stored_master_dtype(np.dtype(np.float16), f32, "remainder") == f32
    assert remainders.stored_master_dtype(f32, f32, "remainder") == f32


# --------------------------------------------------------------------------------- the offload

SUBGROUP = "16KiB"
STEPS = 6


def _inner():
    return optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask)


def _train(tx, params, steps, *, route="update", state=None):
    """``steps`` updates through ``route`` (the shared ``train``): "update" (+ apply_updates), "jit" (update
    traced) or "apply" (fused); from ``tx.init`` unless given a state."""
    state = tx.init(params) if state is None else state
    update = jax.jit(tx.update) if route == "jit" else None
    return train(tx, params, state, steps, update=update, apply=route == "apply")


def _stored_masters(tx) -> list[np.ndarray]:
    pin = tx.pin()
    return [m for sg in tx.plan.subgroups for m in tx.read_pinned(pin, sg.index)[1]]


def test_records_hold_remainders_and_bits_do_not_depend_on_tiering_or_route(paths):
    params = make_params(dtype=jnp.bfloat16)
    options = dict(subgroup_size=SUBGROUP, master_dtype=jnp.float32, master_storage="remainder")
    with jax_mlp.mlp_offload(_inner(), paths=[paths[0] / "a"], **options) as tx:
        reference, _ = _train(tx, params, range(STEPS))
        state_bytes = tx.plan.state_nbytes
        assert all(m.dtype == np.int16 for m in _stored_masters(tx))
    with jax_mlp.mlp_offload(_inner(), paths=[paths[0] / "full"], **{**options, "master_storage": "full"}) as full:
        full.init(params)
        assert full.plan.state_nbytes > 1.1 * state_bytes  # adam's 8 B + 4 B, against 8 B + 2 B
        assert all(m.dtype == np.float32 for m in _stored_masters(full))

    variants = {
        "two_paths_part_cache": (dict(paths=[paths[0] / "b", paths[1] / "b"], host_cache=state_bytes // 3), "update"),
        "three_paths_full_cache": (dict(paths=[p / "c" for p in paths], host_cache=2 * state_bytes), "update"),
        "fused_apply": (dict(paths=[paths[0] / "d"], host_cache=state_bytes // 2), "apply"),
        "in_jit": (dict(paths=[paths[1] / "e"]), "jit"),
        "pinned_transfer": (dict(paths=[paths[2] / "f"], transfer="pinned"), "update"),
    }
    for variant, (where, route) in variants.items():
        with jax_mlp.mlp_offload(_inner(), **where, **options) as tx:
            params_out, _ = _train(tx, jax.tree.map(jnp.copy, params), range(STEPS), route=route)
        assert_same_bits(params_out, reference, variant)


def _in_memory(params, steps, inner):
    """The scheme in memory: optax on an fp32 master, the params its bf16 cast."""
    master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    state = inner.init(master)
    for step in steps:
        grads = jax.tree.map(
            lambda g: g.astype(jnp.float32), grads_at(jax.tree.map(lambda m: m.astype(jnp.bfloat16), master), step)
        )
        updates, state = inner.update(grads, state, master)
        master = optax.apply_updates(master, updates)
    return master


@pytest.mark.parametrize("storage", ["remainder", "full"])
def test_params_changed_between_steps(storage, paths):
    """With remainders the master follows params the user changed (loaded, averaged); a full master
    overrides them at the next update."""
    params = make_params(dtype=jnp.bfloat16)
    with jax_mlp.mlp_offload(
        optax.sgd(0.0), paths=[paths[0]], subgroup_size=SUBGROUP, master_dtype=jnp.float32, master_storage=storage
    ) as tx:
        state = tx.init(params)
        params, state = _train(tx, params, range(2), state=state)
        changed = jax.tree.map(lambda p: (0.5 * p.astype(jnp.float32) + 0.25).astype(jnp.bfloat16), params)
        updates, state = tx.update(grads_at(changed, 2), state, changed)
        after = optax.apply_updates(changed, updates)
    if storage == "remainder":
        assert_same_bits(after, changed, "a zero step keeps the params the user set")
    else:
        assert_same_bits(after, params, "the full master snaps the params back")


def _gpt_against_the_in_memory_scheme(out: pathlib.Path) -> None:
    """Trains ``examples/train_gpt.py``'s model in bf16 100 steps three ways, fed the same grads: optax on an fp32
    master in memory (params its bf16 cast), the offload's update route and its fused apply. Writes the
    :func:`bf16_distance` of each route from the in-memory params, and how far the params moved, to ``out``.

    The grads are those of the in-memory params, so the trajectory is optax's own: neither route's
    last-bit differences feed back into it. Run in a process of its own
    (:func:`test_a_gpt_trains_100_steps_within_one_ulp_of_the_in_memory_scheme_through_both_routes`).
    """
    from flax import nnx

    gpt = load_module(pathlib.Path(__file__).parents[1] / "examples" / "train_gpt.py")
    args = gpt.parse_args(["--steps", "100", "--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "32"])
    tokens = gpt.encode(gpt.build_corpus())
    batches = gpt.Batches(tokens, 16, args.seq_len, args.seed)
    model = gpt.GPT(len(gpt.VOCAB), args.seq_len, args.d_model, args.layers, args.heads, rngs=nnx.Rngs(args.seed))
    graphdef, state = nnx.split(model)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.to_pure_dict(state))

    @jax.jit
    def grads_of(pure, inputs, targets):
        local = jax.tree.map(lambda x: x, state)  # a new State: the traced values stay in it
        nnx.replace_by_pure_dict(local, pure)
        return nnx.to_pure_dict(jax.grad(lambda s: gpt.cross_entropy(nnx.merge(graphdef, s), inputs, targets))(local))

    inner = gpt.make_adamw(args)
    master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    reference_state = inner.init(master)
    reference_update = jax.jit(inner.update)
    options = dict(subgroup_size="8KiB", host_cache="16KiB", master_dtype=jnp.float32, master_storage="remainder")
    with (
        jax_mlp.mlp_offload(inner, paths=[out.parent / "update"], **options) as by_update,
        jax_mlp.mlp_offload(inner, paths=[out.parent / "apply"], **options) as by_apply,
    ):
        update_state, apply_state = by_update.init(params), by_apply.init(params)
        updated, applied = params, jax.tree.map(jnp.copy, params)
        for _ in range(args.steps):
            grads = grads_of(jax.tree.map(lambda m: m.astype(jnp.bfloat16), master), *batches.next())
            updates, update_state = by_update.update(grads, update_state, updated)
            updated = optax.apply_updates(updated, updates)
            applied, apply_state = by_apply.apply(jax.tree.map(jnp.copy, grads), apply_state, applied)
            updates, reference_state = reference_update(
                jax.tree.map(lambda g: g.astype(jnp.float32), grads), reference_state, master
            )
            master = optax.apply_updates(master, updates)
    expected = jax.tree.map(lambda m: m.astype(jnp.bfloat16), master)
    moved = max(
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        for a, b in zip(jax.tree.leaves(updated), jax.tree.leaves(params), strict=True)
    )
    distances = {"update": bf16_distance(updated, expected), "apply": bf16_distance(applied, expected)}
    out.write_text(json.dumps({"moved": moved, **distances}))


def test_a_gpt_trains_100_steps_within_one_ulp_of_the_in_memory_scheme_through_both_routes(tmp_path):
    """``examples/train_gpt.py``'s model in bf16, adamw with its schedule: the update route and the fused apply
    against optax on an fp32 master in memory, fed the same grads.

    A bf16 ulp at a master near zero is far below the last-bit differences XLA's fusion leaves
    between a subgroup's program and optax's program over the whole tree (its division rewrites
    depend on how many leaves share the bias correction), so whether some element ends 2 ulps off
    depends on the trajectory: on which masters pass near zero. The trajectory follows the bits of
    the model's bf16 matmuls, and those depended on what ran before in the same process (on a Xeon
    with AMX, where XLA hands bf16 dots to oneDNN, 2 runs of 3 in the suite ended 2 ulps off while
    the test alone passed). So it runs in a process of its own, without the suite's shared
    compilation cache: the same trajectory, whatever ran before.
    """
    out = tmp_path / "distances.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    script = f"import pathlib, test_remainders; test_remainders._gpt_against_the_in_memory_scheme(pathlib.Path({str(out)!r}))"
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=pathlib.Path(__file__).parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["moved"] > 0.01, "the params must move for the comparison to mean anything"
    assert_bf16_bound(tuple(result["update"]), "update + apply_updates against the in-memory scheme")
    assert_bf16_bound(tuple(result["apply"]), "fused apply against the in-memory scheme")


def test_tiers_of_full_masters_resume_as_full_and_are_refused_as_remainders(paths):
    """Tiers written with whole masters (also before remainders existed) are read with
    ``master_storage="full"``; resuming them as remainders names that difference."""
    params = make_params(dtype=jnp.bfloat16)
    options = dict(paths=[paths[0]], subgroup_size=SUBGROUP, master_dtype=jnp.float32)
    with jax_mlp.mlp_offload(_inner(), **options) as tx:  # whole masters, the default
        expected, _ = _train(tx, params, range(3))
    run_json = paths[0] / "proc0000" / "run.json"
    identity = json.loads(run_json.read_text())
    assert identity["plan"].pop("master_storage") == "full"
    run_json.write_text(json.dumps(identity))  # as the format before remainders wrote it
    with (
        pytest.raises(jax_mlp.RecordError, match=r"full masters, this offload's remainder.*master_storage='full'"),
        jax_mlp.mlp_offload(_inner(), resume=True, master_storage="remainder", **options) as refused,
    ):
        refused.init(params)
    with jax_mlp.mlp_offload(_inner(), resume=True, **options) as tx:
        state = tx.init(params)
        assert int(state.step) == 3
        assert_same_bits(jax_mlp.restore_params(tx, params), expected)
