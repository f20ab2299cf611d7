"""The shared state on the user's handle (counts, injected hyperparameters) and extra arguments of update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import (
    EXACT_BOUND,
    abstract,
    assert_close_to_optax,
    assert_same_bits,
    grads_at,
    make_params,
    max_relative_deviation,
    train,
)

import jax_mlp

SHAPES = {"w": (24, 8), "b": (8,), "u": (6, 4)}
OPTIONS = {"subgroup_size": "1KiB", "host_cache": 0}  # four subgroups; "w" is cut into row chunks
CHANGE_AT, STEPS, NEW_RATE = 5, 8, 3e-3


def inject() -> optax.GradientTransformation:
    return optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=1e-3)


def train_changing_rate(tx, params, state, steps, update=None):
    """Trains for ``steps`` (the shared ``train``), setting the learning rate to ``NEW_RATE`` before step
    ``CHANGE_AT``."""
    steps = list(steps)
    at = steps.index(CHANGE_AT) if CHANGE_AT in steps else len(steps)
    params, state = train(tx, params, state, steps[:at], update=update)
    if at < len(steps):
        state.hyperparams["learning_rate"] = NEW_RATE
    return train(tx, params, state, steps[at:], update=update)


def assert_matches_optax(params, start, steps=STEPS):
    expected, expected_state = train_changing_rate(inject(), start, inject().init(start), range(steps))
    assert_close_to_optax(params, expected, start)
    return expected_state


def test_changing_the_learning_rate_at_step_5_matches_inject_hyperparams_in_memory(tmp_path):
    start = make_params(SHAPES)
    with jax_mlp.mlp_offload(inject(), paths=tmp_path, **OPTIONS) as tx:
        state = tx.init(start)
        assert len(tx.plan.subgroups) >= 3
        assert float(state.hyperparams["learning_rate"]) == pytest.approx(1e-2)
        params, state = train_changing_rate(tx, start, state, range(STEPS))
    expected_state = assert_matches_optax(params, start)
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(NEW_RATE)
    assert float(optax.tree_utils.tree_get(state, "learning_rate")) == pytest.approx(NEW_RATE)
    assert int(state.shared.count) == int(expected_state.count) == STEPS
    # The change mattered: without it, the params differ by far more than the tolerance.
    unchanged = optax.adamw(1e-2, weight_decay=1e-3)
    plain, _ = train(unchanged, start, unchanged.init(start), range(STEPS))
    assert max(max_relative_deviation(params, plain).values()) > 100 * EXACT_BOUND


def test_the_shared_state_passes_through_jit_and_a_change_inside_reaches_every_subgroup(tmp_path):
    start = make_params(SHAPES)
    with jax_mlp.mlp_offload(inject(), paths=tmp_path, **OPTIONS) as tx:
        state = tx.init(start)
        params, state = train_changing_rate(tx, start, state, range(STEPS), update=jax.jit(tx.update))
    assert_matches_optax(params, start)
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(NEW_RATE)


def test_the_changed_rate_survives_a_restart_and_a_checkpoint(tmp_path):
    start = make_params(SHAPES)
    paths = [tmp_path / "a", tmp_path / "b"]
    with jax_mlp.mlp_offload(inject(), paths=paths, **OPTIONS) as tx:
        params, state = train_changing_rate(tx, start, tx.init(start), range(CHANGE_AT + 1))
        with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
            manager.save(CHANGE_AT + 1, args=ocp.args.Composite(opt_state=jax_mlp.OffloadSave(tx)))
        resumed_at = params
    with jax_mlp.mlp_offload(inject(), paths=paths, resume=True, **OPTIONS) as tx:
        state = tx.init(start)
        assert float(state.hyperparams["learning_rate"]) == pytest.approx(NEW_RATE)
        assert int(state.shared.count) == CHANGE_AT + 1
        resumed, _ = train_changing_rate(tx, resumed_at, state, range(CHANGE_AT + 1, STEPS))
    with jax_mlp.mlp_offload(inject(), paths=tmp_path / "c", **OPTIONS) as tx:
        with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
            args = ocp.args.Composite(opt_state=jax_mlp.OffloadRestore(tx, abstract(start)))
            state = manager.restore(CHANGE_AT + 1, args=args)["opt_state"]
        assert float(state.hyperparams["learning_rate"]) == pytest.approx(NEW_RATE)
        restored, _ = train_changing_rate(tx, resumed_at, state, range(CHANGE_AT + 1, STEPS))
    with jax_mlp.mlp_offload(inject(), paths=tmp_path / "d", **OPTIONS) as tx:
        straight, _ = train_changing_rate(tx, start, tx.init(start), range(STEPS))
    assert_same_bits(resumed, straight, "a restart changed the bits")
    assert_same_bits(restored, straight, "a checkpoint restore changed the bits")


def test_a_shared_state_of_another_structure_is_refused_and_the_step_stays(tmp_path):
    start = make_params(SHAPES)
    with jax_mlp.mlp_offload(inject(), paths=tmp_path, **OPTIONS) as tx:
        state = tx.init(start)
        with pytest.raises(jax_mlp.OffloadError, match="keeping their structure and shapes"):
            tx.update(grads_at(start, 0), state._replace(shared=None), start)
        state.hyperparams["learning_rate"] = jnp.ones(3)
        with pytest.raises(jax_mlp.OffloadError, match="keeping their structure and shapes"):
            tx.update(grads_at(start, 0), state, start)
        state.hyperparams["learning_rate"] = 1e-2  # a Python float is cast to the stored dtype
        _, state = tx.update(grads_at(start, 0), state, start)
        assert int(state.step) == 1 and state.hyperparams["learning_rate"].dtype == jnp.float32


def test_an_optimizer_without_injected_hyperparameters_says_so():
    with pytest.raises(AttributeError, match=r"not made with optax\.inject_hyperparams"):
        _ = jax_mlp.OffloadState(jnp.int32(0), optax.EmptyState()).hyperparams


# ----------------------------------------------------------------------------- extra arguments


def scale_by_extra_arg() -> optax.GradientTransformationExtraArgs:
    """A leaf-wise transformation that multiplies each update by the extra argument ``scale``."""

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None, *, scale, **extra_args):
        del params, extra_args
        return jax.tree.map(lambda u: u * scale, updates), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def scaled_adam() -> optax.GradientTransformationExtraArgs:
    return optax.chain(optax.adam(1e-2), scale_by_extra_arg())


def test_a_declared_extra_argument_reaches_every_subgroup_eagerly_and_inside_jit(tmp_path):
    start = make_params(SHAPES)
    declared = {"scale": jax.ShapeDtypeStruct((), jnp.float32)}

    def run(tx, state, update):
        params = start
        for step in range(4):
            updates, state = update(grads_at(params, step), state, params, scale=jnp.float32(0.5 + step))
            params = optax.apply_updates(params, updates)
        return params

    expected = run(scaled_adam(), scaled_adam().init(start), scaled_adam().update)
    for name, jit in (("eager", False), ("jit", True)):
        with jax_mlp.mlp_offload(scaled_adam(), paths=tmp_path / name, extra_args=declared, **OPTIONS) as tx:
            got = run(tx, tx.init(start), jax.jit(tx.update) if jit else tx.update)
        assert_close_to_optax(got, expected, what=name)


def test_a_required_extra_argument_must_be_declared(tmp_path):
    with (
        pytest.raises(jax_mlp.OffloadError, match="declare them: mlp_offload"),
        jax_mlp.mlp_offload(scaled_adam(), paths=tmp_path, **OPTIONS) as tx,
    ):
        tx.init(make_params(SHAPES))
    assert not list(tmp_path.rglob("*.json"))


def global_scale_if_given() -> optax.GradientTransformationExtraArgs:
    """Leaf-wise without ``value``; with it, every update is divided by the global gradient norm."""

    def update_fn(updates, state, params=None, *, value=None, **extra_args):
        del params, extra_args
        if value is None:
            return updates, state
        norm = optax.tree.norm(updates)
        return jax.tree.map(lambda u: u * value / norm, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)


def test_an_undeclared_extra_argument_is_checked_at_its_first_update(tmp_path):
    start = make_params(SHAPES)
    with jax_mlp.mlp_offload(optax.chain(optax.sgd(1e-2), global_scale_if_given()), paths=tmp_path, **OPTIONS) as tx:
        state = tx.init(start)
        with pytest.raises(jax_mlp.CoupledOptimizerError, match="global_scale_if_given"):
            tx.update(grads_at(start, 0), state, start, value=jnp.float32(1.0))
        with pytest.raises(jax_mlp.OffloadError, match="passes only arrays"):
            tx.update(grads_at(start, 0), state, start, obj_fn=lambda p: p)
        _, state = tx.update(grads_at(start, 0), state, start)  # the step was left intact
        assert int(state.step) == 1


def leaf_norm_if_given() -> optax.GradientTransformationExtraArgs:
    """Element-wise without ``value``; with it, each update is divided by its own leaf's norm (rows mix)."""

    def update_fn(updates, state, params=None, *, value=None, **extra_args):
        del params, extra_args
        if value is None:
            return updates, state
        return jax.tree.map(lambda u: u * value / jnp.linalg.norm(u), updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)


def test_an_undeclared_extra_argument_that_mixes_the_rows_of_a_split_leaf_is_refused(tmp_path):
    start = make_params(SHAPES)
    inner = optax.chain(optax.adam(1e-2), leaf_norm_if_given())
    with jax_mlp.mlp_offload(inner, paths=tmp_path / "a", **OPTIONS) as tx:
        state = tx.init(start)
        with pytest.raises(jax_mlp.OffloadError, match=r"mixes the rows of param \['w'\], which this plan cuts"):
            tx.update(grads_at(start, 0), state, start, value=jnp.float32(1.0))
    declared = {"value": jax.ShapeDtypeStruct((), jnp.float32)}
    with jax_mlp.mlp_offload(inner, paths=tmp_path / "b", extra_args=declared, **OPTIONS) as tx:
        with pytest.warns(UserWarning, match=r"param \['w'\] is kept whole"):
            state = tx.init(start)
        assert all(p.rows is None for sg in tx.plan.subgroups for p in sg.pieces)
        _, state = tx.update(grads_at(start, 0), state, start, value=jnp.float32(1.0))
        assert int(state.step) == 1
