"""Orbax checkpoints of a ``jax_mlp.stream_layers`` run: its params and state streamed out of the tiers into the
standard optax layout beside training, and back into a new run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import assert_close_to_optax, assert_same_bits
from test_layers import LAYERS, OPTIONS, STACK, batch_at, model, stack_layers, unstack

import jax_mlp

SAVED_AT, STEPS = 2, 5


def shapes(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def train_and_save(tmp_path, inner, outer, stacked, **options):
    """Trains ``STEPS`` steps, saving at ``SAVED_AT`` while training goes on; returns the params at each end."""
    with (
        jax_mlp.stream_layers(STACK, inner, paths=[tmp_path / "run"], **options) as stream,
        ocp.CheckpointManager(tmp_path / "checkpoints") as manager,
    ):
        state = stream.init(outer, stacked)
        for step in range(STEPS):
            if step == SAVED_AT:  # a deferred update of the last step: the save runs it first
                manager.save(step, args=ocp.args.Composite(model=jax_mlp.OffloadSave(stream)))
                saved = stream.params()
            _, state = stream.step(state, batch_at(step))
        manager.wait_until_finished()
        return saved, stream.params()


def restore_and_train(tmp_path, inner, outer, stacked, **options):
    """A new run on other paths restored from the checkpoint, trained to ``STEPS``."""
    like = (shapes(outer), shapes(stacked))
    with (
        jax_mlp.stream_layers(STACK, inner, paths=[tmp_path / "elsewhere"], **options) as stream,
        ocp.CheckpointManager(tmp_path / "checkpoints") as manager,
    ):
        restored = manager.restore(SAVED_AT, args=ocp.args.Composite(model=jax_mlp.OffloadRestore(stream, like)))
        state = restored["model"]
        assert int(state.step) == SAVED_AT
        for step in range(SAVED_AT, STEPS):
            _, state = stream.step(state, batch_at(step))
        return stream.params()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16 with fp32 remainder masters", "float32, updates deferred"])
def test_a_checkpoint_saved_beside_training_restores_on_other_paths_and_ends_bitwise(dtype, tmp_path):
    """Restored on other paths with another host cache; saved beside training (after a step whose update was
    deferred, the save runs that update first)."""
    bf16 = dtype.startswith("bfloat16")
    outer, stacked = model(jnp.bfloat16 if bf16 else jnp.float32)
    options = dict(OPTIONS, master_dtype=jnp.float32, master_storage="remainder") if bf16 else OPTIONS
    if dtype.endswith("deferred"):
        options = dict(OPTIONS, max_grad_norm=6.0, clipping="defer")
    inner = optax.adam(1e-2)
    _, uninterrupted = train_and_save(tmp_path, inner, outer, stacked, **options)
    resumed = restore_and_train(tmp_path, inner, outer, stacked, **dict(options, host_cache="1KiB"))
    assert_same_bits(resumed, uninterrupted, f"restored from the checkpoint of step {SAVED_AT}, {dtype}")


def test_plain_optax_restores_the_checkpoint_and_trains_on_as_the_stream_does(tmp_path):
    """The item is the standard layout: ``{"opt_state": inner.init(model tree), "params": model tree}``. Plain orbax
    restores it; the params are those the stream held at that step, and optax in memory, from that state,
    trains on as the stream did."""
    outer, stacked = model()
    inner = optax.adam(1e-2)
    saved, streamed = train_and_save(tmp_path, inner, outer, stacked, **OPTIONS)
    tree = {"layers": unstack(saved[1], LAYERS), "outer": saved[0]}
    layout = jax_mlp.standard_layout(inner, tree, with_params=True)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "checkpoints" / str(SAVED_AT) / "model", layout)
    assert_same_bits(restored["params"], tree, "the checkpoint's params")
    assert int(restored["opt_state"][0].count) == SAVED_AT
    params, state = restored["params"], restored["opt_state"]
    for step in range(SAVED_AT, STEPS):
        updates, state = jax.jit(inner.update)(jax.grad(STACK.loss)(params, batch_at(step)), state, params)
        params = optax.apply_updates(params, updates)
    expected = (params["outer"], stack_layers(params["layers"]))
    assert_close_to_optax(streamed, expected, saved)


def test_a_checkpoint_without_params_is_refused_before_anything_is_written(tmp_path):
    outer, stacked = model()
    tree = {"layers": unstack(stacked, LAYERS), "outer": outer}
    inner = optax.adam(1e-2)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "optax", inner.init(tree))
    stream = jax_mlp.stream_layers(STACK, inner, paths=[tmp_path / "tiers"])
    restore = jax_mlp.OffloadRestore(stream, (shapes(outer), shapes(stacked)))
    with stream, pytest.raises(jax_mlp.OffloadError, match="holds no params"):
        ocp.Checkpointer(jax_mlp.OffloadCheckpointHandler()).restore(tmp_path / "optax", args=restore)
    assert not (tmp_path / "tiers").exists() or not list((tmp_path / "tiers").iterdir())


def test_a_checkpoint_without_masters_restores_into_a_run_with_masters_started_from_its_params(tmp_path):
    """bf16 params saved without a master copy, restored into a run that keeps fp32 remainder masters: the masters
    start from the checkpoint's params, which come back bit for bit, and training goes on from them."""
    outer, stacked = model(jnp.bfloat16)
    inner = optax.adam(1e-2)
    saved, _ = train_and_save(tmp_path, inner, outer, stacked, **OPTIONS)
    masters = dict(OPTIONS, master_dtype=jnp.float32, master_storage="remainder")
    like = (shapes(outer), shapes(stacked))
    with (
        jax_mlp.stream_layers(STACK, inner, paths=[tmp_path / "with masters"], **masters) as stream,
        ocp.CheckpointManager(tmp_path / "checkpoints") as manager,
    ):
        state = manager.restore(SAVED_AT, args=ocp.args.Composite(model=jax_mlp.OffloadRestore(stream, like)))["model"]
        assert_same_bits(stream.params(), saved, "the params restored")
        _, state = stream.step(state, batch_at(SAVED_AT))
        assert int(state.step) == SAVED_AT + 1
        stepped = stream.params()
    for before, after in zip(jax.tree.leaves(saved), jax.tree.leaves(stepped), strict=True):
        moved = np.abs(np.asarray(after, np.float32) - np.asarray(before, np.float32))
        assert 0 < moved.max() <= 2e-2, moved.max()  # one adam step of 1e-2 from the masters the params gave
