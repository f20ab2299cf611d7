"""``plan/optimizer_check.py`` and ``plan/dependencies.py``: the optimizer check reads leaf and row coupling from
jaxprs; the plan keeps row-coupled leaves whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import scale_by_global_norm

import jax_mlp
from jax_mlp._src.errors import OffloadError
from jax_mlp._src.plan import partition
from jax_mlp._src.plan.optimizer_check import REMEDY, CoupledOptimizerError, check_optimizer

TREE = {
    "embed": jax.ShapeDtypeStruct((12, 4), np.float32),
    "dense": {"w": jax.ShapeDtypeStruct((4, 6), np.float32), "b": jax.ShapeDtypeStruct((6,), np.float32)},
    "row": jax.ShapeDtypeStruct((1, 6), np.float32),
}
NAMES = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(TREE)[0]]
LEAVES = jax.tree.leaves(TREE)
MATRICES = frozenset(i for i, x in enumerate(LEAVES) if x.ndim == 2 and x.shape[0] > 1)
SPLITTABLE = frozenset(i for i, x in enumerate(LEAVES) if x.ndim >= 1 and x.shape[0] > 1)


def _decay_mask(params):
    return jax.tree.map(lambda p: p.ndim > 1, params)


LEAF_WISE = {
    "adam": lambda: optax.adam(1e-3),
    "adamw_mask": lambda: optax.adamw(1e-3, weight_decay=0.1, mask=_decay_mask),
    "lion": lambda: optax.lion(1e-4),
    "sgd_nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "schedule_free_adamw": lambda: optax.contrib.schedule_free_adamw(1e-2),
    "schedule_free_sgd_wrapper": lambda: optax.contrib.schedule_free(optax.sgd(1e-2), 1e-2),
    "ademamix": lambda: optax.contrib.ademamix(1e-3),
    "multi_transform": lambda: optax.multi_transform(
        {"a": optax.adam(1e-3), "s": optax.sgd(1e-2)}, lambda t: jax.tree.map(lambda p: "a" if p.ndim > 1 else "s", t)
    ),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3),
}
ROW_COUPLED = {  # optimizer, and the leaves at least that must stay whole
    "adafactor": (lambda: optax.adafactor(1e-2, min_dim_size_to_factor=2), MATRICES),
    "lamb": (lambda: optax.lamb(1e-3), SPLITTABLE),
    "lars": (lambda: optax.lars(1.0), SPLITTABLE),
    "muon": (lambda: optax.contrib.muon(1e-2), MATRICES),
}
COUPLED = {
    "dog": lambda: optax.contrib.dog(1.0),
    "dowg": lambda: optax.contrib.dowg(1.0),
    "prodigy": lambda: optax.contrib.prodigy(1.0),
    "dadapt_adamw": lambda: optax.contrib.dadapt_adamw(1.0),
    "clip_by_global_norm_inside": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
}


@pytest.mark.parametrize("name", LEAF_WISE)
def test_leaf_wise_optimizers_pass_and_may_be_row_split(name):
    check = check_optimizer(LEAF_WISE[name](), TREE, None)
    assert check.whole_leaves == frozenset()
    assert check.seconds > 0


@pytest.mark.parametrize("name", ROW_COUPLED)
def test_row_coupled_optimizers_keep_their_leaves_whole(name):
    make, whole = ROW_COUPLED[name]
    check = check_optimizer(make(), TREE, None)
    assert whole <= check.whole_leaves <= SPLITTABLE  # a leaf of one row cannot be split anyway


def test_muon_keeps_only_matrices_whole():
    # muon runs adam on the other leaves, and those may be split.
    assert check_optimizer(optax.contrib.muon(1e-2), TREE, None).whole_leaves == MATRICES


@pytest.mark.parametrize("name", COUPLED)
def test_cross_leaf_optimizers_are_refused_with_two_leaves_and_the_remedy(name):
    with pytest.raises(CoupledOptimizerError) as caught:
        check_optimizer(COUPLED[name](), TREE, None)
    message = str(caught.value)
    assert REMEDY in message
    assert sum(leaf in message for leaf in NAMES) >= 2, message


def test_the_refusal_names_the_transformation():
    with pytest.raises(CoupledOptimizerError, match=r"clip_by_global_norm \(optax/.*\.py:\d+\)"):
        check_optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), TREE, None)
    with pytest.raises(CoupledOptimizerError, match="scale_by_dog"):
        check_optimizer(optax.contrib.dog(1.0), TREE, None)


def test_an_optimizer_needing_undeclared_extra_arguments_is_refused_and_checked_once_declared():
    with pytest.raises(OffloadError, match="declare them: mlp_offload") as caught:
        check_optimizer(optax.polyak_sgd(), TREE, None)
    assert REMEDY in str(caught.value)
    # With the loss declared, the trace goes through and shows polyak's global step size.
    with pytest.raises(CoupledOptimizerError, match="scale_by_polyak"):
        check_optimizer(optax.polyak_sgd(), TREE, None, {"value": jax.ShapeDtypeStruct((), np.float32)})


def test_a_leaf_wise_use_of_an_extra_argument_passes():
    plateau = optax.chain(optax.sgd(1e-2), optax.contrib.reduce_on_plateau())
    assert check_optimizer(plateau, TREE, None, {"value": jnp.zeros(())}).whole_leaves == frozenset()


def test_a_planted_global_norm_transformation_is_refused_by_name():
    with pytest.raises(CoupledOptimizerError, match=r"scale_by_global_norm \(.*helpers\.py:\d+\)") as caught:
        check_optimizer(optax.chain(optax.adam(1e-3), scale_by_global_norm()), TREE, None)
    assert "['dense']['b']" in str(caught.value) and "['dense']['w']" in str(caught.value)


def sum_of_first_leaf_in_shared_state() -> optax.GradientTransformation:
    """A planted transformation whose shared scalar state is computed from one leaf only."""

    def init_fn(params):
        del params
        return jnp.zeros([], jnp.float32)

    def update_fn(updates, state, params=None):
        del params
        return updates, state + jnp.sum(jax.tree.leaves(updates)[0])

    return optax.GradientTransformation(init_fn, update_fn)


def test_shared_state_computed_from_a_leaf_is_refused():
    with pytest.raises(CoupledOptimizerError, match="is one value for the whole tree") as caught:
        check_optimizer(sum_of_first_leaf_in_shared_state(), TREE, None)
    assert NAMES[0] in str(caught.value)


def test_shared_state_computed_from_the_only_leaf_is_refused_too():
    # Its row chunks would each compute their own value; the handle holds one for all subgroups.
    single = {"w": jax.ShapeDtypeStruct((8, 4), np.float32)}
    with pytest.raises(CoupledOptimizerError, match=r"\.estim_lr \(DAdaptAdamWState\) is one value"):
        check_optimizer(optax.contrib.dadapt_adamw(1.0), single, None)


def per_leaf_control_flow() -> optax.GradientTransformation:
    """Leaf-wise and row-wise, but through a jit over the whole tree, a cond, a fori_loop and a scan."""

    def init_fn(params):
        return optax.ScaleByAdamState(jnp.zeros([], jnp.int32), optax.tree.zeros_like(params), params)

    @jax.jit
    def leafwise(tree, count):
        def one(g):
            g = jax.lax.cond(count > 2, lambda x: x * 2.0, lambda x: x + 1.0, g)
            g = jax.lax.fori_loop(0, 3, lambda _, x: jnp.tanh(x), g)
            if g.ndim == 2:  # a scan along columns keeps rows apart
                g = jax.lax.scan(lambda c, col: (c + col, c * col), jnp.zeros(g.shape[0]), g.T)[1].T
            return g

        return jax.tree.map(one, tree)

    def update_fn(updates, state, params=None):
        del params
        count = state.count + 1
        mu = leafwise(updates, count)
        return mu, optax.ScaleByAdamState(count, mu, state.nu)

    return optax.GradientTransformation(init_fn, update_fn)


def test_nested_jaxprs_are_followed_not_taken_as_coupling():
    assert check_optimizer(per_leaf_control_flow(), TREE, None).whole_leaves == frozenset()


def test_a_leaf_wise_norm_is_row_coupling_not_cross_leaf():
    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        del params
        return jax.tree.map(lambda u: u / (jnp.linalg.norm(u) + 1e-6), updates), state

    check = check_optimizer(optax.GradientTransformation(init_fn, update_fn), TREE, None)
    assert check.whole_leaves == SPLITTABLE


def test_prng_keys_in_state_are_refused_by_name():
    with pytest.raises(OffloadError, match=r"\[0\]\.rng_key \(AddNoiseState\) holds a PRNG key") as caught:
        check_optimizer(optax.noisy_sgd(1e-3, key=0), TREE, None)
    assert "before mlp_offload" in str(caught.value)


def legacy_key_noise() -> optax.GradientTransformation:
    """Noise drawn from a raw uint32 key: no typed key in the state, but random bits in the jaxpr."""

    def init_fn(params):
        del params
        return jax.random.PRNGKey(0)

    def update_fn(updates, state, params=None):
        del params
        key, sub = jax.random.split(state)
        keys = jax.random.split(sub, len(jax.tree.leaves(updates)))
        leaves, treedef = jax.tree.flatten(updates)
        noisy = [u + jax.random.normal(k, u.shape) for u, k in zip(leaves, keys, strict=True)]
        return jax.tree.unflatten(treedef, noisy), key

    return optax.GradientTransformation(init_fn, update_fn)


def test_random_numbers_from_a_raw_key_are_refused():
    with pytest.raises(OffloadError, match=r"draws random numbers .* in legacy_key_noise"):
        check_optimizer(legacy_key_noise(), TREE, None)


def test_params_may_be_low_precision_sharded_arrays():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    sharded = jax.device_put(
        jnp.ones((4, 6), jnp.bfloat16), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    )
    params = {"w": sharded, "b": jnp.zeros((6,), jnp.bfloat16)}
    assert check_optimizer(optax.adam(1e-3), params, np.dtype(np.float32)).whole_leaves == frozenset()
    assert check_optimizer(optax.lamb(1e-3), params, np.dtype(np.float32)).whole_leaves == {0, 1}


def test_galore_is_refused_where_its_init_fails_on_a_view():
    with pytest.raises(OffloadError, match="None in place of the leaves outside it"):
        partition.make_plan(TREE, optax.contrib.galore(1e-2, rank=2), 256)


# ----------------------------------------------------------------------------- whole leaves in the plan

PLAN_TREE = {"big": jax.ShapeDtypeStruct((64, 8), np.float32), "b": jax.ShapeDtypeStruct((8,), np.float32)}
BIG = 1  # "b" < "big" in tree_leaves order


def test_a_whole_leaf_above_the_subgroup_size_is_a_subgroup_of_its_own():
    inner = optax.adam(1e-3)
    split = partition.make_plan(PLAN_TREE, inner, 1024)
    assert any(p.rows is not None for sg in split.subgroups for p in sg.pieces if p.leaf == BIG)
    plan = partition.make_plan(PLAN_TREE, inner, 1024, whole_leaves=frozenset({BIG}))
    assert [sg.pieces for sg in plan.subgroups] == [(partition.Piece(0),), (partition.Piece(BIG),)]
    assert plan.layout_hash != split.layout_hash


def test_no_whole_leaves_or_small_ones_leave_the_plan_as_it_was():
    inner = optax.adam(1e-3)
    for size in (1024, 1 << 20):
        before = partition.make_plan(PLAN_TREE, inner, size)
        assert partition.make_plan(PLAN_TREE, inner, size, whole_leaves=frozenset()) == before
    roomy = partition.make_plan(PLAN_TREE, inner, 1 << 20)
    assert partition.make_plan(PLAN_TREE, inner, 1 << 20, whole_leaves=frozenset({0, BIG})) == roomy


def test_a_whole_leaf_cut_into_shards_is_refused_and_a_replicated_one_kept():
    inner = optax.lamb(1e-3)
    halves = (partition.Shard(((0, 32), (0, 8)), 0), partition.Shard(((32, 64), (0, 8)), 1))
    with pytest.raises(OffloadError, match=r"param \['big'\] \(64, 8\) is sharded into blocks"):
        partition.make_plan(PLAN_TREE, inner, 1024, shards=[None, halves], whole_leaves=frozenset({BIG}))
    replicated = (partition.Shard(((0, 64), (0, 8)), 1),)
    plan = partition.make_plan(PLAN_TREE, inner, 1024, shards=[None, replicated], whole_leaves=frozenset({BIG}))
    assert [p for sg in plan.subgroups for p in sg.pieces if p.leaf == BIG] == [
        partition.Piece(BIG, None, replicated[0])
    ]


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_compressed_state_stays_row_wise_so_its_leaves_may_be_row_split(codec):
    # int8 reduces each block along the last axis and broadcasts its word back: rows stay rows.
    wide = {"w": jax.ShapeDtypeStruct((8, 512), np.float32), "b": jax.ShapeDtypeStruct((512,), np.float32)}
    check = check_optimizer(jax_mlp.quantized_state(optax.adam(1e-3), codec), wide, None)
    assert check.whole_leaves == frozenset()


def test_a_gather_that_reorders_rows_keeps_the_leaf_whole():
    def reorder(updates, state, params=None):
        return jax.tree.map(lambda u: u[jnp.argsort(u[:, 0])] if u.ndim == 2 else u, updates), state

    check = check_optimizer(optax.GradientTransformation(lambda p: optax.EmptyState(), reorder), TREE, None)
    assert check.whole_leaves >= MATRICES


def test_an_init_that_fails_on_the_params_names_the_tree_it_holds_not_extra_args():
    """A mask of another structure fails ``inner.init`` (as in plain optax): the refusal says which tree, and
    offers neither ``extra_args`` nor moving global transformations, which ``init`` has nothing to do with."""
    mask = {"embed": True, "dense": {"w": True}, "row": False}  # no "b"
    with pytest.raises(
        OffloadError, match=r"inner.init could not be traced .* key path tree_map tree\['dense'\]"
    ) as caught:
        check_optimizer(optax.adamw(1e-3, mask=mask), TREE, None)
    assert "a mask=" in str(caught.value) and "extra_args" not in str(caught.value)
    assert REMEDY not in str(caught.value)
