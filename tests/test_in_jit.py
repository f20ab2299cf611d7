"""``update`` traced inside ``jax.jit`` and ``nnx.jit``: per-device host callbacks inside ``shard_map``."""

from __future__ import annotations

import jax
import optax
import pytest
from conftest import OPTIMIZERS, grads_at, make_params, max_relative_deviation
from test_flax import train
from test_sharding import mesh_2x4, sharded_params

import jax_mlp

TOLERANCE = 1e-5


def jitted_training(tx, params, steps: int):
    @jax.jit
    def step_fn(params, opt_state, step):
        updates, opt_state = tx.update(grads_at(params, step), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    for step in range(steps):
        params, opt_state = step_fn(params, opt_state, step)
    return params, opt_state


def eager_optax(inner, params, steps: int):
    state = inner.init(params)
    for step in range(steps):
        updates, state = inner.update(grads_at(params, step), state, params)
        params = optax.apply_updates(params, updates)
    return params


def test_update_inside_jit_matches_optax(tmp_path):
    params = make_params()
    inner = OPTIMIZERS["adamw_mask"]()
    tx = jax_mlp.mlp_offload(inner, paths=[tmp_path / "a", tmp_path / "b"], subgroup_size="24KiB")
    got, opt_state = jitted_training(tx, params, steps=10)
    assert int(opt_state.step) == 10 and tx.stats.step == 10
    assert len(tx.offloader.plan.subgroups) > 8
    expected = eager_optax(inner, params, steps=10)
    deviation = max_relative_deviation(got, expected)
    assert max(deviation.values()) <= TOLERANCE, deviation
    tx.close()


def test_sharded_params_inside_jit_get_a_clear_error_and_work_eagerly(tmp_path):
    params = sharded_params(mesh_2x4())
    tx = jax_mlp.mlp_offload(optax.adam(1e-2), paths=tmp_path)
    opt_state = tx.init(params)
    with pytest.raises(ValueError, match=r"param \['big'\] is sharded over 8 devices.*outside jit"):
        jax.jit(tx.update)(grads_at(params, 0), opt_state, params)
    _, opt_state = tx.update(grads_at(params, 0), opt_state, params)
    assert int(opt_state.step) == 1
    tx.close()


def test_jit_and_eager_updates_interleave_on_one_state(tmp_path):
    params = make_params()
    inner = optax.adam(1e-2)
    tx = jax_mlp.mlp_offload(inner, paths=tmp_path, subgroup_size="24KiB")
    opt_state = tx.init(params)
    jitted = jax.jit(tx.update)
    for step in range(4):
        update = jitted if step % 2 else tx.update
        updates, opt_state = update(grads_at(params, step), opt_state, params)
        params = optax.apply_updates(params, updates)
    expected = eager_optax(inner, make_params(), steps=4)
    assert max(max_relative_deviation(params, expected).values()) <= TOLERANCE
    tx.close()


def test_a_failed_jitted_update_asks_for_resume(tmp_path):
    params = make_params()
    tx = jax_mlp.mlp_offload(optax.adam(1e-2), paths=tmp_path)
    opt_state = tx.init(params)
    stale = jax.tree.map(lambda x: x, opt_state)
    jitted = jax.jit(tx.update)
    _, opt_state = jitted(grads_at(params, 0), opt_state, params)
    with pytest.raises(Exception, match="step 0, but the offloaded state is at step 1"):
        jax.block_until_ready(jitted(grads_at(params, 1), stale, params))
    with pytest.raises(Exception, match="resume=True"):
        jax.block_until_ready(jitted(grads_at(params, 1), opt_state, params))
    tx.close()
    resumed = jax_mlp.mlp_offload(optax.adam(1e-2), paths=tmp_path, resume=True)
    assert int(resumed.init(params).step) == 1
    resumed.close()


def test_nnx_optimizer_update_inside_nnx_jit(tmp_path):
    inner = optax.adamw(1e-2, weight_decay=0.1)
    offload = jax_mlp.mlp_offload(inner, paths=tmp_path, subgroup_size="2KiB")
    got = train(optax.chain(optax.clip_by_global_norm(1.0), offload), 8, update_in_jit=True)
    assert offload.stats.step == 8 and len(offload.offloader.plan.subgroups) >= 3
    offload.close()
    expected = train(optax.chain(optax.clip_by_global_norm(1.0), inner), 8, update_in_jit=True)
    deviation = max_relative_deviation(jax.tree.leaves(got), jax.tree.leaves(expected))
    assert max(deviation.values()) <= TOLERANCE, deviation
