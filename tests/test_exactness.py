"""Same math as in-memory optax, and bits that never depend on the tiering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    EXACT_BOUND,
    LOW_PRECISION_STATE_BOUND,
    OPTIMIZERS,
    assert_bf16_within_ulp,
    assert_close_to_optax,
    assert_same_bits,
    grads_at,
    make_params,
    max_relative_deviation,
    run_offload,
    run_optax,
)

import jax_mlp
from jax_mlp._src.plan import partition, remainders

STEPS = 10
SUBGROUP = "16KiB"


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_same_math_as_optax_and_bits_independent_of_tiering(name, paths):
    inner = OPTIMIZERS[name]()
    params = make_params()
    # adafactor's factored state is small: a smaller subgroup still gives many subgroups, none split.
    subgroup_size = "4KiB" if name == "adafactor" else SUBGROUP
    plan = partition.make_plan(params, inner, jax_mlp.parse_size(subgroup_size))
    split = any(p.rows is not None for sg in plan.subgroups for p in sg.pieces)
    assert len(plan.subgroups) >= 5
    assert split == (name != "adafactor"), "adafactor must run on unsplit leaves; the others on a split leaf"
    state_bytes = plan.state_nbytes

    reference = run_offload(inner, params, STEPS, [paths[0] / "a"], subgroup_size=subgroup_size, prefetch_depth=1)[0]
    variants = {
        "part_cache_two_paths": dict(
            paths=[paths[0] / "b", paths[1] / "b"], host_cache=state_bytes // 3, prefetch_depth=3
        ),
        "full_cache_three_paths": dict(paths=[p / "c" for p in paths], host_cache=2 * state_bytes, write_depth=1),
        "reopened": dict(paths=[paths[0] / "d", paths[1] / "d"], host_cache=state_bytes // 2, reopen_at=STEPS // 2),
    }
    for variant, options in variants.items():
        other = run_offload(inner, params, STEPS, options.pop("paths"), subgroup_size=subgroup_size, **options)[0]
        assert_same_bits(other, reference, variant)

    for jit in (False, True):
        assert_close_to_optax(reference, run_optax(inner, params, STEPS, jit=jit), what=f"jit={jit}")


@pytest.mark.parametrize("master", [False, True])
def test_layers_packed_in_the_order_users_number_them_do_the_same_math(master, paths):
    # Twelve layers l0..l11 (one cut into row chunks): the natural order packs l9, l10 and l11 together, which
    # the flattened tree orders l10, l11, l9; each subgroup's view and record must still match its leaves.
    shapes = {f"l{i}": {"w": (8 + i, 12), "b": (12,)} for i in range(12)} | {"l10": {"w": (96, 12), "b": (12,)}}
    dtype = jnp.bfloat16 if master else jnp.float32
    params, inner = make_params(shapes, dtype=dtype), OPTIMIZERS["adamw_mask"]()
    options = {"subgroup_size": "3KiB", "master_dtype": jnp.float32 if master else None}
    plan = partition.make_plan(params, inner, jax_mlp.parse_size("3KiB"), options["master_dtype"])
    tree = partition.make_plan(params, inner, jax_mlp.parse_size("3KiB"), options["master_dtype"], leaf_order="tree")
    assert [sg.pieces for sg in plan.subgroups] != [sg.pieces for sg in tree.subgroups]
    assert any(p.rows is not None for sg in plan.subgroups for p in sg.pieces)
    offloaded = run_offload(inner, params, STEPS, [paths[0]], host_cache="4KiB", **options)[0]
    assert_same_bits(offloaded, run_offload(inner, params, STEPS, [paths[1]], reopen_at=4, **options)[0])
    for jit in (False, True):
        if master:
            assert_bf16_within_ulp(offloaded, _master_scheme(inner, params, jit=jit), f"jit={jit}")
        else:
            assert_close_to_optax(offloaded, run_optax(inner, params, STEPS, jit=jit), what=f"jit={jit}")


def test_low_precision_state_within_looser_bound(paths):
    inner = optax.adam(1e-2, mu_dtype=jnp.bfloat16)
    params = make_params()
    offloaded = run_offload(inner, params, STEPS, [paths[0]], subgroup_size=SUBGROUP)[0]
    for jit in (False, True):
        expected = run_optax(inner, params, STEPS, jit=jit)
        assert_close_to_optax(offloaded, expected, bound=LOW_PRECISION_STATE_BOUND, what=f"jit={jit}")


def test_a_skipped_subgroup_is_far_above_the_bound(paths):
    """The tolerance is tight enough to catch a real bug: one subgroup's update skipped once."""
    inner = optax.adam(1e-2)
    params = make_params()
    with jax_mlp.mlp_offload(inner, paths=[paths[0]], subgroup_size=SUBGROUP) as tx:
        state = tx.init(params)
        skipped_leaf = tx.plan.subgroups[2].pieces[0].leaf
        offloaded = params
        for step in range(STEPS):
            updates, state = tx.update(grads_at(offloaded, step), state, offloaded)
            if step == 4:
                leaves, treedef = jax.tree.flatten(updates)
                leaves[skipped_leaf] = jnp.zeros_like(leaves[skipped_leaf])
                updates = jax.tree.unflatten(treedef, leaves)
            offloaded = optax.apply_updates(offloaded, updates)
    deviations = max_relative_deviation(offloaded, run_optax(inner, params, STEPS, jit=True))
    assert max(deviations.values()) > 100 * EXACT_BOUND, deviations


def _master_scheme(inner, params, *, jit: bool):
    """bf16 ``params`` trained in memory with fp32 masters, for ``STEPS`` steps: the scheme offloaded masters run."""
    master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    state = inner.init(master)
    update = jax.jit(inner.update) if jit else inner.update
    for step in range(STEPS):
        grads = jax.tree.map(
            lambda g: g.astype(jnp.float32), grads_at(jax.tree.map(lambda m: m.astype(jnp.bfloat16), master), step)
        )
        updates, state = update(grads, state, master)
        master = optax.apply_updates(master, updates)
    return jax.tree.map(lambda m: m.astype(jnp.bfloat16), master)


def test_bf16_params_with_fp32_master(paths):
    """bf16 params, fp32 master in the tiers: within one bf16 ulp of the same scheme in memory."""
    inner = optax.adamw(1e-2, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    params = make_params(dtype=jnp.bfloat16)
    expected = _master_scheme(inner, params, jit=True)

    with jax_mlp.mlp_offload(inner, paths=[paths[0]], subgroup_size=SUBGROUP, master_dtype=jnp.float32) as tx:
        opt_state = tx.init(params)
        for step in range(STEPS):
            grads = grads_at(params, step)
            assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(params))

    assert_bf16_within_ulp(params, expected, "offloaded against the same scheme in memory")


def _masters_of(tx, params) -> list[np.ndarray]:
    """The fp32 master of each leaf at the offload's step: stored whole, or rebuilt from the params' high half."""
    offloader = tx
    leaves = jax.tree.leaves(params)
    masters = [np.empty(x.shape, np.float32) for x in leaves]
    pin = offloader.pin()
    for subgroup in offloader.plan.subgroups:
        for piece, stored in zip(subgroup.pieces, offloader.read_pinned(pin, subgroup.index)[1], strict=True):
            rows = Ellipsis if piece.rows is None else slice(*piece.rows)
            held = leaves[piece.leaf][rows]
            master = np.asarray(stored if stored.dtype == np.float32 else remainders.rebuild(held, stored))
            words = remainders.split(master)[0] if stored.dtype == np.int16 else master.astype(jnp.bfloat16)
            assert_same_bits(held, words)  # apply_updates landed on the master's bf16 word
            masters[piece.leaf][rows] = master
    pin.release()
    return masters


def test_apply_updates_gives_exactly_the_master_cast_and_remainders_rebuild_the_full_master(paths):
    """Fed the same gradients, a full master and one rebuilt from remainders and params are the same bits.

    One subgroup holds everything in both, so that both run the same program on the same view (other
    row chunks may round the inner update differently, by an fp32 ulp).
    """
    start = make_params(dtype=jnp.bfloat16)
    masters = {}
    for storage, path in zip(("full", "remainder"), paths, strict=False):
        with jax_mlp.mlp_offload(
            optax.adam(1e-2), paths=[path], subgroup_size="1MiB", master_dtype=jnp.float32, master_storage=storage
        ) as tx:
            state, params = tx.init(start), start
            assert len(tx.plan.subgroups) == 1
            for step in range(3):
                updates, state = tx.update(grads_at(start, step), state, params)
                params = optax.apply_updates(params, updates)
            masters[storage] = _masters_of(tx, params)
    assert_same_bits(masters["remainder"], masters["full"])
