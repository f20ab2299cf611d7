"""mlp_offload inside flax: nnx.Optimizer, nnx.split with flax's TrainState, and the trees flax hands in.

The update is called eagerly, split from the jitted grads, or inside jit; every tree comes back in the
types it went in (``nnx.Param``, ``FrozenDict``, custom pytree nodes), as plain optax returns them.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import linen, nnx
from flax.core import FrozenDict
from flax.training import train_state
from helpers import EXACT_BOUND, assert_close_to_optax

import jax_mlp


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(8, 64, rngs=rngs)
        self.norm = nnx.LayerNorm(64, rngs=rngs)
        self.out = nnx.Linear(64, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.gelu(self.norm(self.hidden(x))))


def train(tx, steps: int = 12, *, update_in_jit: bool = False):
    """Trains the MLP with ``nnx.Optimizer``: the update outside ``nnx.jit``, or inside it."""
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = jax.random.normal(jax.random.PRNGKey(1), (32, 8))
    y = jnp.sum(jnp.sin(x), axis=1, keepdims=True)

    def grads_of(model):
        return nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)

    @nnx.jit
    def train_step(model, optimizer):
        optimizer.update(model, grads_of(model))

    jitted_grads = nnx.jit(grads_of)
    for _ in range(steps):
        if update_in_jit:
            train_step(model, optimizer)
        else:
            optimizer.update(model, jitted_grads(model))
    return nnx.state(model, nnx.Param)


def test_nnx_optimizer_matches_plain_optax(tmp_path):
    inner = optax.adamw(1e-2, weight_decay=0.1)
    with jax_mlp.mlp_offload(inner, paths=[tmp_path / "tier"], subgroup_size="2KiB", host_cache="4KiB") as offload:
        got = train(optax.chain(optax.clip_by_global_norm(1.0), offload))
        assert len(offload.plan.subgroups) >= 3
        assert offload.stats.step == 12
    expected = train(optax.chain(optax.clip_by_global_norm(1.0), inner))
    assert_close_to_optax(jax.tree.leaves(got), jax.tree.leaves(expected))


def test_nnx_optimizer_accumulates_like_multisteps(tmp_path):
    inner = optax.adamw(1e-2, weight_decay=0.1)
    clip = optax.clip_by_global_norm(1.0)
    expected = train(optax.chain(clip, optax.MultiSteps(inner, every_k_schedule=3)))
    with jax_mlp.mlp_offload(inner, paths=[tmp_path], subgroup_size="2KiB", accumulate_steps=3) as offload:
        got = train(optax.chain(clip, offload))
        assert offload.step == 4
    assert_close_to_optax(jax.tree.leaves(got), jax.tree.leaves(expected))


def test_fused_apply_on_an_nnx_model_matches_plain_optax(tmp_path):
    """``apply_to`` behind a global clip run by hand: the chain's math, the params replaced in place."""
    with jax_mlp.mlp_offload(
        optax.adamw(1e-2, weight_decay=0.1), paths=[tmp_path / "tier"], subgroup_size="2KiB"
    ) as offload:
        clip = optax.clip_by_global_norm(1.0)
        model = MLP(nnx.Rngs(0))
        x = jax.random.normal(jax.random.PRNGKey(1), (32, 8))
        y = jnp.sum(jnp.sin(x), axis=1, keepdims=True)
        grads_of = nnx.jit(lambda model: nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model))
        clip_state, opt_state = clip.init(nnx.state(model, nnx.Param)), offload.init(nnx.state(model, nnx.Param))
        for _ in range(12):
            grads, clip_state = clip.update(grads_of(model), clip_state)
            opt_state = offload.apply_to(model, grads, opt_state)
        assert int(opt_state.step) == 12 and len(offload.plan.subgroups) >= 3
        offload.close(delete=True)
    expected = train(optax.chain(clip, optax.adamw(1e-2, weight_decay=0.1)))
    assert_close_to_optax(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(expected))


# ----------------------------------------------------------------------------- trees come back as they went in


class Count(nnx.Variable):
    """A non-param variable, as in flax's ``nnx_toy_examples/03_train_state.py``."""


class CountingMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.count = Count(jnp.array(0))
        self.linear1 = nnx.Linear(4, 32, rngs=rngs)
        self.linear2 = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        self.count[...] += 1
        return self.linear2(jax.nn.relu(self.linear1(x)))


class SplitTrainState(train_state.TrainState):
    """flax's ``TrainState`` holding an NNX model split into graphdef, params and counts."""

    counts: nnx.State
    graphdef: nnx.GraphDef


def decay_mask_of(params):
    """adamw's weight-decay mask as a tree of ``nnx.Param``s, built from the params as plain optax allows."""
    return jax.tree.map(lambda p: p.ndim > 1, params)


def train_split(make_tx, steps: int = 6, *, in_jit: bool):
    """The functional NNX style: ``nnx.split`` into a ``TrainState``, ``apply_gradients`` in or out of jit.

    Returns the start params, the final state and the updates of the last step.
    """
    graphdef, params, counts = nnx.split(CountingMLP(nnx.Rngs(0)), nnx.Param, Count)
    state = SplitTrainState.create(apply_fn=None, graphdef=graphdef, params=params, tx=make_tx(params), counts=counts)
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 4))
    y = jnp.sum(x**2, axis=1, keepdims=True)

    @jax.jit
    def grads_of(state):
        def loss_fn(params):
            model = nnx.merge(state.graphdef, params, state.counts, copy=True)
            return jnp.mean((model(x) - y) ** 2), nnx.state(model, Count)

        return jax.grad(loss_fn, has_aux=True)(state.params)

    def train_step(state):
        grads, counts = grads_of(state)
        return state.apply_gradients(grads=grads, counts=counts)

    step = jax.jit(train_step) if in_jit else train_step
    for _ in range(steps):
        state = step(state)
    return params, state


def assert_matches_optax(got, expected, start) -> None:
    """The exactness contract on trees of ``nnx.Param``: same structure, each leaf and its displacement
    within the bound of plain optax's, and every leaf moved by more than that bound (so it could fail)."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(expected)
    assert_close_to_optax(got, expected, start)
    for (path, e), p0 in zip(jax.tree_util.tree_flatten_with_path(expected)[0], jax.tree.leaves(start), strict=True):
        e, p0 = np.asarray(e, np.float64), np.asarray(p0, np.float64)
        assert np.max(np.abs(e - p0)) > EXACT_BOUND * np.max(np.abs(e)), f"{jax.tree_util.keystr(path)} did not move"


@pytest.mark.parametrize("in_jit", [False, True], ids=["eager", "jit"])
def test_nnx_split_train_state_with_a_param_tree_mask_matches_plain_optax(tmp_path, in_jit):
    """flax's 03_train_state.py with the optimizer swapped: ``nnx.Param`` trees in, ``nnx.Param`` trees out."""

    def adamw(params):
        return optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask_of(params))

    with contextlib.ExitStack() as made:
        offloads = []

        def offload(params):
            offloads.append(
                made.enter_context(jax_mlp.mlp_offload(adamw(params), paths=[tmp_path], subgroup_size="512B"))
            )
            return offloads[0]

        start, got = train_split(offload, in_jit=in_jit)
        assert int(got.opt_state.step) == 6 and len(offloads[0].plan.subgroups) >= 3
    _, expected = train_split(adamw, in_jit=in_jit)
    assert isinstance(got.params["linear1"]["kernel"], nnx.Param)
    assert int(got.counts["count"][...]) == 6
    assert_matches_optax(got.params, expected.params, start)


class CNN(nnx.Module):
    """The shape of flax's MNIST CNN, tiny: conv, pool, conv, pool, two dense layers."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(4, 8, kernel_size=(3, 3), rngs=rngs)
        self.linear1 = nnx.Linear(2 * 2 * 8, 16, rngs=rngs)
        self.linear2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        x = nnx.avg_pool(nnx.relu(self.conv1(x)), window_shape=(2, 2), strides=(2, 2))
        x = nnx.avg_pool(nnx.relu(self.conv2(x)), window_shape=(2, 2), strides=(2, 2))
        return self.linear2(nnx.relu(self.linear1(x.reshape(x.shape[0], -1))))


def train_cnn(tx, steps: int = 5, *, in_jit: bool):
    """NNX's MNIST tutorial loop: ``nnx.Optimizer(model, tx, wrt=nnx.Param)``, ``optimizer.update(model, grads)``."""
    model = CNN(nnx.Rngs(0))
    start = nnx.state(model, nnx.Param)
    start = jax.tree.map(jnp.copy, start)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    images = jax.random.normal(jax.random.PRNGKey(2), (8, 8, 8, 1))
    labels = jnp.arange(8) % 3

    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(images), labels).mean()

    def train_step(model, optimizer):
        optimizer.update(model, nnx.grad(loss_fn)(model))

    if in_jit:
        step = nnx.jit(train_step)
    else:
        grads_of = nnx.jit(nnx.grad(loss_fn))

        def step(model, optimizer):
            optimizer.update(model, grads_of(model))

    for _ in range(steps):
        step(model, optimizer)
    return start, nnx.state(model, nnx.Param)


@pytest.mark.parametrize("in_jit", [False, True], ids=["eager", "nnx_jit"])
def test_nnx_optimizer_cnn_matches_plain_optax(tmp_path, in_jit):
    with jax_mlp.mlp_offload(optax.adamw(1e-2, weight_decay=0.1), paths=[tmp_path], subgroup_size="1KiB") as offload:
        start, got = train_cnn(offload, in_jit=in_jit)
        assert offload.step == 5 and len(offload.plan.subgroups) >= 3
    _, expected = train_cnn(optax.adamw(1e-2, weight_decay=0.1), in_jit=in_jit)
    assert_matches_optax(got, expected, start)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Dense:
    """A custom pytree node holding params."""

    w: jax.Array
    b: jax.Array


TREES = {
    "frozen_dict": lambda p: FrozenDict(p),
    "custom_node": lambda p: {"dense": Dense(p["w"], p["b"]), "scale": p["scale"]},
    "nnx_params": lambda p: nnx.State({k: nnx.Param(v) for k, v in p.items()}),
}


@pytest.mark.parametrize("kind", list(TREES))
def test_updates_and_applied_params_keep_the_tree_given(tmp_path, kind):
    """``update`` (eager and in jit) returns updates, and ``apply`` params, in the tree types given, as optax does."""
    plain = {"w": jnp.linspace(-1.0, 1.0, 48).reshape(8, 6), "b": jnp.linspace(0.5, -0.5, 6), "scale": jnp.ones(3)}
    params = TREES[kind](plain)
    grads = jax.tree.map(lambda p: jnp.cos(3 * p), params)
    inner = optax.adam(1e-2)
    expected, _ = inner.update(grads, inner.init(params), params)
    with jax_mlp.mlp_offload(inner, paths=[tmp_path], subgroup_size="128B") as tx:
        state = tx.init(params)
        eager, state = tx.update(grads, state, params)
        jitted, state = jax.jit(tx.update)(grads, state, params)
        applied, _ = tx.apply(jax.tree.map(jnp.copy, grads), state, jax.tree.map(jnp.copy, params))
    for tree in (eager, jitted, applied):
        assert jax.tree_util.tree_structure(tree) == jax.tree_util.tree_structure(params)
    for a, e in zip(jax.tree.leaves(eager), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-6)


def test_a_checkpoint_of_nnx_params_restores_into_plain_optax_and_a_new_offload(tmp_path):
    """The standard layout of a plan on ``nnx.Param`` trees is plain optax's ``inner.init(params)``, Variables kept."""
    params = nnx.state(nnx.Linear(8, 4, rngs=nnx.Rngs(0)), nnx.Param)
    grads = jax.tree.map(lambda p: jnp.cos(3 * p), params)
    inner = optax.adam(1e-2)
    with jax_mlp.mlp_offload(inner, paths=[tmp_path / "a"], subgroup_size="128B") as tx:
        _, state = tx.update(grads, tx.init(params), params)
        with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
            manager.save(1, args=ocp.args.Composite(opt_state=jax_mlp.OffloadSave(tx)))
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    expected = inner.update(grads, inner.init(params), params)[1]
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:  # a manager per restore: orbax binds its handler
        layout = ocp.args.StandardRestore(jax_mlp.standard_layout(inner, like))
        plain = manager.restore(1, args=ocp.args.Composite(opt_state=layout))["opt_state"]
    with jax_mlp.mlp_offload(inner, paths=[tmp_path / "b"], subgroup_size="128B") as resumed:
        with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
            state = manager.restore(1, args=ocp.args.Composite(opt_state=jax_mlp.OffloadRestore(resumed, like)))
        assert jax.tree_util.tree_structure(plain) == jax.tree_util.tree_structure(expected)
        for a, e in zip(jax.tree.leaves(plain), jax.tree.leaves(expected), strict=True):
            np.testing.assert_array_equal(a, e)
        updates, _ = resumed.update(grads, state["opt_state"], params)
    assert isinstance(updates["kernel"], nnx.Param) and int(state["opt_state"].step) == 1


class LinenMLP(linen.Module):
    """A small linen model, as in flax's linen examples (lm1b's blocks, shrunk): params come as plain dicts."""

    @linen.compact
    def __call__(self, x):
        x = linen.gelu(linen.Dense(32)(x))
        return linen.Dense(1)(linen.LayerNorm()(x))


def train_linen(tx, steps: int = 5, *, in_jit: bool):
    """flax's linen loop: ``TrainState.create`` and ``state.apply_gradients``, in a jitted step or after jitted grads."""
    model = LinenMLP()
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8))
    y = jnp.sum(jnp.cos(x), axis=1, keepdims=True)
    params = model.init(jax.random.PRNGKey(0), x)["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    grads_of = jax.grad(lambda p: jnp.mean((model.apply({"params": p}, x) - y) ** 2))
    if in_jit:
        step = jax.jit(lambda state: state.apply_gradients(grads=grads_of(state.params)))
    else:
        jitted = jax.jit(grads_of)

        def step(state):
            return state.apply_gradients(grads=jitted(state.params))

    for _ in range(steps):
        state = step(state)
    return params, state


@pytest.mark.parametrize("in_jit", [False, True], ids=["eager", "jit"])
def test_linen_train_state_matches_plain_optax(tmp_path, in_jit):
    inner = optax.adamw(1e-2, weight_decay=0.1)
    with jax_mlp.mlp_offload(inner, paths=[tmp_path], subgroup_size="512B") as offload:
        start, got = train_linen(offload, in_jit=in_jit)
        assert int(got.opt_state.step) == 5 and len(offload.plan.subgroups) >= 3
    _, expected = train_linen(inner, in_jit=in_jit)
    assert_matches_optax(got.params, expected.params, start)
