"""The fused apply: the same params as update plus apply_updates, written over the donated params."""

from __future__ import annotations

import contextlib
import errno
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from faults import inject_write_faults
from helpers import EXACT_BOUND, assert_close_to_optax, assert_same_bits, grads_at, make_params, train
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_mlp

SUBGROUP = "16KiB"  # splits params["big"] into row chunks
STEPS = 3


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


@contextlib.contextmanager
def _both_routes(inner, params, tmp_path, steps=STEPS, **options):
    """Params after ``steps`` of update + apply_updates, and of apply, from the same start; and the offload that
    applied, open inside the ``with`` (then closed, its files deleted)."""
    with (
        jax_mlp.mlp_offload(inner, paths=[tmp_path / "update"], subgroup_size=SUBGROUP, **options) as by_update,
        jax_mlp.mlp_offload(inner, paths=[tmp_path / "apply"], subgroup_size=SUBGROUP, **options) as by_apply,
    ):
        p_update, p_apply = params, _copy(params)
        s_update, s_apply = by_update.init(p_update), by_apply.init(p_apply)
        assert any(p.rows is not None for sg in by_apply.plan.subgroups for p in sg.pieces)
        p_update, s_update = train(by_update, p_update, s_update, range(steps))
        p_apply, s_apply = train(by_apply, p_apply, s_apply, range(steps), apply=True)
        assert int(s_apply.step) == int(s_update.step) == steps
        by_update.close(delete=True)
        yield p_update, p_apply, by_apply
        by_apply.close(delete=True)


def test_fp32_apply_is_update_plus_apply_updates_within_the_core_tolerance(tmp_path):
    """Not bitwise: XLA fuses ``p + u`` into the update's arithmetic, which moves a few fp32 ulps."""
    start = make_params()
    p0 = _copy(start)
    with _both_routes(optax.adamw(1e-2, weight_decay=0.1), start, tmp_path) as (p_update, p_apply, _):
        _assert_within_core_tolerance(p_apply, p_update, p0)


def _assert_within_core_tolerance(got_tree, want_tree, start_tree):
    """The contract's bound on each leaf and its displacement, against a reference that moved by far more."""
    assert_close_to_optax(got_tree, want_tree, start_tree)
    for want, before in zip(jax.tree.leaves(want_tree), jax.tree.leaves(start_tree), strict=True):
        want, before = np.asarray(want), np.asarray(before)
        assert float(np.max(np.abs(want - before))) > 100 * EXACT_BOUND * float(np.max(np.abs(want)))


@pytest.mark.parametrize("storage", ["remainder", "full"])
def test_bf16_apply_is_the_master_cast_bitwise_as_update_plus_apply_updates(storage, tmp_path):
    params = make_params(dtype=jnp.bfloat16)
    with _both_routes(optax.adam(1e-2), params, tmp_path, master_dtype=jnp.float32, master_storage=storage) as (
        p_update,
        p_apply,
        tx,
    ):
        assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(p_apply))
        assert_same_bits(p_apply, p_update)
        leaves = jax.tree.leaves(p_apply)
        pin = tx.pin()
        for subgroup in tx.plan.subgroups:  # apply writes exactly the new master's cast
            _, master = tx.read_pinned(pin, subgroup.index)
            for piece, value in zip(subgroup.pieces, master, strict=True):
                leaf = np.asarray(leaves[piece.leaf])
                got = leaf if piece.rows is None else leaf[piece.rows[0] : piece.rows[1]]
                if storage == "full":
                    assert_same_bits(got, value.astype(jnp.bfloat16))
                else:  # the params are the high half: tests/test_exactness.py checks the rebuilt master
                    assert value.dtype == np.int16


def test_apply_consumes_params_and_grads(tmp_path):
    with jax_mlp.mlp_offload(optax.adam(1e-3), paths=[tmp_path], subgroup_size=SUBGROUP) as tx:
        params = make_params()
        state = tx.init(params)
        grads = grads_at(params, 0)
        new_params, state = tx.apply(grads, state, params)
        assert all(x.is_deleted() for x in jax.tree.leaves((params, grads)))
        assert not any(x.is_deleted() for x in jax.tree.leaves(new_params))
        tx.close(delete=True)


def test_apply_refuses_an_array_given_twice_and_a_traced_call(tmp_path):
    with jax_mlp.mlp_offload(optax.adam(1e-3), paths=[tmp_path], subgroup_size=SUBGROUP) as tx:
        params = make_params()
        state = tx.init(params)
        with pytest.raises(
            jax_mlp.OffloadError, match=r"grads leaf \['big'\] is the same array as params leaf \['big'\]"
        ):
            tx.apply({**grads_at(params, 0), "big": params["big"]}, state, params)
        with pytest.raises(jax_mlp.OffloadError, match="runs eagerly"):
            jax.jit(tx.apply)(grads_at(params, 0), state, params)
        params, state = tx.apply(grads_at(params, 0), state, params)  # nothing was consumed by the refusals
        assert int(state.step) == 1
        tx.close(delete=True)


def test_apply_refuses_accumulation_before_consuming_anything(tmp_path):
    with jax_mlp.mlp_offload(optax.adam(1e-3), paths=[tmp_path], subgroup_size=SUBGROUP, accumulate_steps=2) as tx:
        params = make_params()
        state = tx.init(params)
        with pytest.raises(jax_mlp.OffloadError, match="does not accumulate gradients"):
            tx.apply(grads_at(params, 0), state, params)
        _, state = tx.update(grads_at(params, 0), state, params)  # the params are still usable
        assert int(state.mini_step) == 1
        tx.close(delete=True)


def test_apply_of_sharded_params_keeps_their_sharding_and_matches_update(tmp_path):
    mesh = jax.make_mesh((2, 4), ("replica", "fsdp"), devices=jax.devices()[:8])
    specs = {"big": P("fsdp", None), "embed": P(), "temperature": P()}

    def placed(tree):
        return {k: jax.device_put(tree[k], NamedSharding(mesh, specs[k])) for k in specs}

    params = placed(make_params())
    p0 = jax.device_get(params)
    with _both_routes(optax.adam(1e-2), params, tmp_path, steps=2) as (p_update, p_apply, _):
        for got, want in zip(jax.tree.leaves(p_apply), jax.tree.leaves(p_update), strict=True):
            assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
        _assert_within_core_tolerance(p_apply, p_update, p0)


def test_a_failed_apply_leaves_the_step_intact_and_restore_params_gives_the_params_back(tmp_path, monkeypatch):
    """apply consumes the params, so after a failure mid-stream they come back from the masters in the tiers."""

    fault = inject_write_faults(monkeypatch)

    def run(path, steps, fail_at=None):
        with jax_mlp.mlp_offload(
            optax.adam(1e-2), paths=[path], subgroup_size=SUBGROUP, master_dtype=jnp.float32, master_storage="full"
        ) as tx:
            params = make_params(dtype=jnp.bfloat16)
            like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
            state = tx.init(params)
            for step in range(steps):
                if step == fail_at:
                    tx.flush()
                    fault.fail(
                        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    )  # every record write, as on a full disk
                    with pytest.raises(jax_mlp.PathError, match="is full"):
                        tx.apply(grads_at(params, step), state, params)
                    fault.clear()
                    assert tx.step == step and any(x.is_deleted() for x in jax.tree.leaves(params))
                    params = jax_mlp.restore_params(tx, like)
                params, state = tx.apply(grads_at(params, step), state, params)
            tx.close(delete=True)
        return params

    expected = run(tmp_path / "reference", 4)
    got = run(tmp_path / "faulty", 4, fail_at=2)
    assert_same_bits(got, expected)


def test_apply_gives_every_subgroup_the_handles_hyperparameters(tmp_path):
    with jax_mlp.mlp_offload(
        optax.inject_hyperparams(optax.adam)(learning_rate=1e-2), paths=[tmp_path], subgroup_size=SUBGROUP
    ) as tx:
        params = make_params()
        state = tx.init(params)
        params, state = tx.apply(grads_at(params, 0), state, params)
        before = jax.device_get(params)
        state.hyperparams["learning_rate"] = jnp.zeros_like(state.hyperparams["learning_rate"])
        params, state = tx.apply(grads_at(params, 1), state, params)
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(before), strict=True):
            np.testing.assert_array_equal(np.asarray(got), want)  # a zero learning rate reached every subgroup
        assert int(state.step) == 2 and int(state.shared.count) == 2
        tx.close(delete=True)
