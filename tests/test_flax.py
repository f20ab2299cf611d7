"""mlp_offload inside flax: nnx.Optimizer with the update called eagerly, split from the jitted grads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from helpers import assert_close_to_optax

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
    offload = jax_mlp.mlp_offload(inner, paths=[tmp_path / "tier"], subgroup_size="2KiB", host_cache="4KiB")
    got = train(optax.chain(optax.clip_by_global_norm(1.0), offload))
    assert len(offload.offloader.plan.subgroups) >= 3
    assert offload.stats.step == 12
    offload.close()
    expected = train(optax.chain(optax.clip_by_global_norm(1.0), inner))
    assert_close_to_optax(jax.tree.leaves(got), jax.tree.leaves(expected))


def test_nnx_optimizer_accumulates_like_multisteps(tmp_path):
    inner = optax.adamw(1e-2, weight_decay=0.1)
    clip = optax.clip_by_global_norm(1.0)
    expected = train(optax.chain(clip, optax.MultiSteps(inner, every_k_schedule=3)))
    offload = jax_mlp.mlp_offload(inner, paths=[tmp_path], subgroup_size="2KiB", accumulate_steps=3)
    got = train(optax.chain(clip, offload))
    assert offload.offloader.step == 4
    offload.close()
    assert_close_to_optax(jax.tree.leaves(got), jax.tree.leaves(expected))


def test_fused_apply_on_an_nnx_model_matches_plain_optax(tmp_path):
    """``apply_to`` behind a global clip run by hand: the chain's math, the params replaced in place."""
    offload = jax_mlp.mlp_offload(optax.adamw(1e-2, weight_decay=0.1), paths=[tmp_path / "tier"], subgroup_size="2KiB")
    clip = optax.clip_by_global_norm(1.0)
    model = MLP(nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (32, 8))
    y = jnp.sum(jnp.sin(x), axis=1, keepdims=True)
    grads_of = nnx.jit(lambda model: nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model))
    clip_state, opt_state = clip.init(nnx.state(model, nnx.Param)), offload.init(nnx.state(model, nnx.Param))
    for _ in range(12):
        grads, clip_state = clip.update(grads_of(model), clip_state)
        opt_state = offload.apply_to(model, grads, opt_state)
    assert int(opt_state.step) == 12 and len(offload.offloader.plan.subgroups) >= 3
    offload.close(delete=True)
    expected = train(optax.chain(clip, optax.adamw(1e-2, weight_decay=0.1)))
    assert_close_to_optax(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(expected))
