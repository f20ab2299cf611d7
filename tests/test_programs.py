"""``plan/programs.py``: the device programs are shared, so compiles are counted per shape, not per subgroup (row
chunks of one leaf, identical blocks), and the updates keep the params' commitment, so steady steps compile
nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from helpers import grads_at, make_params

import jax_mlp

SUBGROUP = "16KiB"


def test_chunks_of_one_leaf_share_a_compilation(paths):
    params = {"big": jnp.ones((1024, 64), jnp.float32)}
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size="16KiB") as tx:
        state = tx.init(params)
        _, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
        assert len(tx.plan.subgroups) >= 16
        assert tx.stats.compiles <= 2  # full-size chunks and the last one


def test_identical_blocks_share_one_compilation(paths):
    """24 identical blocks, 3 per subgroup: every subgroup lowers to one program, compiled once."""
    block = {"w": jnp.ones((24, 40)), "b": jnp.zeros((40,)), "scale": jnp.ones((40,))}
    params = {f"block{i:02d}": jax.tree.map(lambda x, i=i: x * (1 + i), block) for i in range(24)}
    inner = optax.adamw(1e-3, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    with jax_mlp.mlp_offload(inner, paths=[paths[0]], subgroup_size=3 * (24 * 40 + 80) * 8) as tx:
        state = tx.init(params)
        init_compiles = tx.stats.compiles
        _, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
        assert len(tx.plan.subgroups) == 8
        assert init_compiles <= 2 and tx.stats.compiles <= 2, (init_compiles, tx.stats.compiles)


def test_updates_keep_the_params_commitment_so_steady_steps_compile_nothing(paths):
    params = dict(make_params(), odd=jnp.ones((5, 11)))  # a shape no other test compiles
    assert not jax.tree.leaves(params)[0].committed
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP, host_cache="64KiB") as tx:
        state = tx.init(params)
        for step in range(3):
            updates, state = tx.update(grads_at(params, step), state, params)
            assert not any(u.committed for u in jax.tree.leaves(updates))
            params = optax.apply_updates(params, updates)
            if step > 0:
                assert tx.stats.compiles == 0, step
        assert tx.stats.total_compiles >= 1
