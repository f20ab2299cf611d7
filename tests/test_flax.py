"""mlp_offload inside flax: nnx.Optimizer with the update called eagerly, split from the jitted grads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from conftest import max_relative_deviation
from flax import nnx

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
    deviations = max_relative_deviation(jax.tree.leaves(got), jax.tree.leaves(expected))
    assert max(deviations.values()) <= 1e-5, deviations


def test_nnx_optimizer_accumulates_like_multisteps_eagerly_and_inside_nnx_jit(tmp_path):
    inner = optax.adamw(1e-2, weight_decay=0.1)
    clip = optax.clip_by_global_norm(1.0)
    expected = train(optax.chain(clip, optax.MultiSteps(inner, every_k_schedule=3)))
    for update_in_jit in (False, True):
        offload = jax_mlp.mlp_offload(
            inner, paths=[tmp_path / str(update_in_jit)], subgroup_size="2KiB", accumulate_steps=3
        )
        got = train(optax.chain(clip, offload), update_in_jit=update_in_jit)
        assert offload.offloader.step == 4
        offload.close()
        deviations = max_relative_deviation(jax.tree.leaves(got), jax.tree.leaves(expected))
        assert max(deviations.values()) <= 1e-5, (update_in_jit, deviations)
