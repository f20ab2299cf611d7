"""``plan/sharding.py``: sharded params on 8 fake CPU devices, a 2x4 mesh, FSDP on one axis and replicated on the
other.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import optax
import pytest
from helpers import OPTIMIZERS, assert_close_to_optax, grads_at, make_params, written_by_last_update
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_mlp
from jax_mlp._src.plan import partition


def mesh_2x4():
    devices = jax.devices()
    if len(devices) < 8:
        pytest.fail("these tests need XLA_FLAGS=--xla_force_host_platform_device_count=8 (set by conftest.py)")
    return jax.make_mesh((2, 4), ("replica", "fsdp"), devices=devices[:8])


def spec_for(path, leaf) -> P:
    """FSDP over 'fsdp' where a dimension divides, replicated over 'replica'; both for the blocks' w1."""
    name = jax.tree_util.keystr(path)
    if "w1" in name:
        return P("replica", "fsdp")
    if leaf.ndim >= 1 and leaf.shape[0] % 4 == 0:
        return P("fsdp")
    if leaf.ndim == 2 and leaf.shape[1] % 4 == 0:
        return P(None, "fsdp")
    return P()


def sharded_params(mesh):
    params = make_params()
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jax.device_put(x, NamedSharding(mesh, spec_for(path, x))), params
    )


def test_sharded_training_matches_optax_and_stores_each_block_once(tmp_path):
    mesh = mesh_2x4()
    params = sharded_params(mesh)
    assert {len(x.sharding.device_set) for x in jax.tree.leaves(params)} == {8}
    inner = OPTIMIZERS["adamw_mask"]()
    with jax_mlp.mlp_offload(inner, paths=[tmp_path / "a", tmp_path / "b"], subgroup_size="24KiB") as tx:
        params = train_keeping_shardings(tx, inner, params, tx.update)

        plan = tx.plan
        assert any(p.rows is not None and p.shard is not None for sg in plan.subgroups for p in sg.pieces), (
            "no split shard"
        )
        for subgroup in plan.subgroups:
            assert len({p.device for p in subgroup.pieces}) == 1, "a subgroup mixes devices"
        # Every element of every leaf is owned by exactly one piece: no replica is stored twice.
        for index, spec in enumerate(plan.leaves):
            owned = [p for sg in plan.subgroups for p in sg.pieces if p.leaf == index]
            elements = sum(math.prod(partition.piece_shape(spec, p)) for p in owned)
            assert elements == math.prod(spec.shape), spec.path
        assert_stored_once(tx, inner, params)


def train_keeping_shardings(tx, inner, params, update, steps: int = 10):
    """``steps`` updates through ``update`` (``tx.update`` or a jitted wrapper), beside in-memory optax.

    Checks every step's updates keep the params' sharding (no device holds more than its block) and
    the final params against optax's. Returns the final params.
    """
    opt_state = tx.init(params)
    expected, state = jax.jit(lambda p: p)(params), inner.init(params)
    for step in range(steps):
        updates, opt_state = update(grads_at(params, step), opt_state, params)
        for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params), strict=True):
            assert u.sharding.is_equivalent_to(p.sharding, p.ndim), "an update lost its sharding"
            assert {s.data.shape for s in u.addressable_shards} == {s.data.shape for s in p.addressable_shards}
        params = optax.apply_updates(params, updates)
        reference, state = inner.update(grads_at(expected, step), state, expected)
        expected = optax.apply_updates(expected, reference)
    assert int(opt_state.step) == steps and tx.stats.step == steps
    assert_close_to_optax(params, expected)
    return params


def assert_stored_once(tx, inner, params) -> None:
    """Closes ``tx`` and checks its bytes on disk: the unique state, one adam count per record; no replica."""
    plan = tx.plan
    unique = sum(x.nbytes for x in jax.tree.leaves(inner.init(params)))
    fields = [f for sg in plan.subgroups for f in (*sg.layout.state_fields, *sg.layout.master_fields)]
    counts = [f for f in fields if f.shape == () and f.dtype == np.int32]
    assert len(counts) == len(plan.subgroups)
    assert sum(f.nbytes for f in fields) - sum(f.nbytes for f in counts) == unique - 4
    expected = written_by_last_update(tx)
    tx.close()
    assert sum(tx.stats.bytes_written.values()) == expected


def test_a_replicated_leaf_is_updated_once_and_copied(tmp_path):
    mesh = mesh_2x4()
    params = {"w": jax.device_put(make_params()["big"], NamedSharding(mesh, P()))}
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=tmp_path) as tx:
        opt_state = tx.init(params)
        (piece,) = [p for sg in tx.plan.subgroups for p in sg.pieces]
        assert piece.shard.device == mesh.devices.flat[0].id
        updates, _ = tx.update(grads_at(params, 0), opt_state, params)
        blocks = [np.asarray(s.data) for s in updates["w"].addressable_shards]
        assert len(blocks) == 8 and all(np.array_equal(b.view(np.uint32), blocks[0].view(np.uint32)) for b in blocks)


def test_grads_with_another_sharding_are_resharded_not_refused(tmp_path):
    mesh = mesh_2x4()
    params = sharded_params(mesh)
    inner = optax.adam(1e-2)
    with jax_mlp.mlp_offload(inner, paths=tmp_path) as tx:
        opt_state = tx.init(params)
        grads = jax.tree.map(lambda g: jax.device_put(g, NamedSharding(mesh, P())), grads_at(params, 0))
        updates, _ = tx.update(grads, opt_state, params)
        expected, _ = inner.update(grads_at(params, 0), inner.init(params), params)
        assert_close_to_optax(updates, expected)
