"""``offload/layers.py`` and ``jax_mlp.stream_layers``: a layer-streamed model whose params, grads and optimizer
state live in the tiers, against the same math held in memory."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_bf16_within_ulp, assert_close_to_optax, assert_same_bits

import jax_mlp
from jax_mlp._src.plan.layer_programs import LayerPrograms

VOCAB, WIDTH, LAYERS, BATCH = 32, 16, 4, 8


def embed(outer, batch):
    return outer["embedding"][batch["tokens"]].astype(outer["embedding"].dtype)


def layer(params, x):
    return x + jnp.tanh(x @ params["w"] + params["b"]).astype(x.dtype)


def head(outer, x, batch):
    return jnp.mean(jnp.square((x @ outer["out"]).astype(jnp.float32) - batch["targets"]))


STACK = jax_mlp.LayerStack(embed, layer, head)


def model(dtype=jnp.float32, layers=LAYERS):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    outer = {
        "embedding": (jax.random.normal(keys[0], (VOCAB, WIDTH)) * 0.5).astype(dtype),
        "out": (jax.random.normal(keys[1], (WIDTH, 3)) * 0.3).astype(dtype),
    }
    stacked = {
        "w": (jax.random.normal(keys[2], (layers, WIDTH, WIDTH)) * 0.2).astype(dtype),
        "b": jnp.zeros((layers, WIDTH), dtype),
    }
    return outer, stacked


def batch_at(step, size=BATCH):
    rng = np.random.default_rng(step)
    return {
        "tokens": jnp.asarray(rng.integers(0, VOCAB, size)),
        "targets": jnp.asarray(rng.normal(size=(size, 3)), jnp.float32),
    }


def unstack(stacked, count):
    return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(count)]


def stack_layers(layers):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


def per_layer_grads(jitted, tree, batch, microbatches=1):
    """The grads of the model tree by the same per-layer programs, micro-batch by micro-batch (horizontal)."""
    total = None
    parts = [
        jax.tree.map(lambda x, m=m: np.asarray(x).reshape(microbatches, -1, *x.shape[1:])[m], batch)
        for m in range(microbatches)
    ]
    for part in parts:
        x = jitted.embed(tree["outer"], part)
        inputs = []
        for params in tree["layers"]:
            inputs.append(x)
            x = jitted.layer(params, x)
        _, (g_outer, gy) = jitted.head(tree["outer"], x, part)
        g_layers = [None] * len(tree["layers"])
        for index in reversed(range(len(tree["layers"]))):
            gy, g_layers[index] = jitted.layer_backward(tree["layers"][index], inputs[index], gy)
        g_outer = jax.tree.map(jnp.add, g_outer, jitted.embed_backward(tree["outer"], part, gy))
        grads = {"layers": g_layers, "outer": g_outer}
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads) if microbatches > 1 else grads
        total = grads if total is None else jax.tree.map(jnp.add, total, grads)
    if microbatches == 1:
        return total
    return jax.tree.map(lambda t, p: (t / microbatches).astype(p.dtype), total, tree)


def in_memory_reference(inner, outer, stacked, steps, tmp_path, *, microbatches=1, clip=None, **options):
    """The same per-layer programs in memory, updated by ``mlp_offload``'s fused apply on the model tree (params on
    the device), the clipping ``optax.clip_by_global_norm``'s own."""
    jitted = LayerPrograms(STACK)
    count = jax.tree.leaves(stacked)[0].shape[0]
    tree = {"layers": unstack(stacked, count), "outer": jax.tree.map(jnp.copy, outer)}  # apply consumes them
    clipping = None if clip is None else optax.clip_by_global_norm(clip)
    with jax_mlp.mlp_offload(inner, paths=[tmp_path / "reference"], **options) as tx:
        state = tx.init(tree)
        for step in steps:
            grads = per_layer_grads(jitted, tree, batch_at(step), microbatches)
            if clipping is not None:
                grads, _ = clipping.update(grads, clipping.init(grads))
            tree, state = tx.apply(grads, state, tree)
    return tree["outer"], stack_layers(tree["layers"])


def train(stream, outer, stacked, steps):
    state = stream.init(outer, stacked)
    losses = []
    for step in steps:
        loss, state = stream.step(state, batch_at(step))
        losses.append(float(loss))
    return stream.params(), losses


OPTIONS = dict(subgroup_size="512B", host_cache="4KiB")  # every leaf cut into row chunks: the plans agree


def test_the_layer_streamed_step_is_bitwise_the_same_programs_in_memory(tmp_path):
    outer, stacked = model()
    inner = optax.adamw(1e-2, weight_decay=0.1)
    with jax_mlp.stream_layers(STACK, inner, paths=[tmp_path / "tiers"], **OPTIONS) as stream:
        (got_outer, got_layers), losses = train(stream, outer, stacked, range(5))
        assert stream.plan.num_layers == LAYERS and all(len(u.subgroups) > 1 for u in stream.plan.units)
    expected = in_memory_reference(inner, outer, stacked, range(5), tmp_path, **OPTIONS)
    assert_same_bits((got_outer, got_layers), expected, "layer-streamed against in memory")
    assert losses[-1] < losses[0]


def test_bf16_params_with_fp32_remainder_masters_and_layer_major_microbatches(tmp_path):
    outer, stacked = model(jnp.bfloat16)
    inner = optax.adam(1e-2)
    options = dict(OPTIONS, master_dtype=jnp.float32, master_storage="remainder")
    with jax_mlp.stream_layers(STACK, inner, microbatches=4, paths=[tmp_path / "tiers"], **options) as stream:
        got, _ = train(stream, outer, stacked, range(4))
        stored = stream.plan.param_layouts[0].state_fields[0]
        assert stored.dtype == jnp.bfloat16  # the params records hold bf16; the remainders are in the state records
    expected = in_memory_reference(inner, outer, stacked, range(4), tmp_path, microbatches=4, **options)
    # Layer-major micro-batches are bitwise the horizontal accumulation in the same order.
    assert_same_bits(got, expected, "4 micro-batches, layer-major against horizontal")


def test_a_clipping_that_fires_is_exact_and_rolled_back(tmp_path):
    outer, stacked = model()
    inner = optax.sgd(1e-2, momentum=0.9)
    clip = 6.0  # the global norms of these steps run from about 5 to 9: it fires in some
    with jax_mlp.stream_layers(STACK, inner, max_grad_norm=clip, paths=[tmp_path / "tiers"], **OPTIONS) as stream:
        got, _ = train(stream, outer, stacked, range(6))
        rolled_back = stream.rolled_back
    expected = in_memory_reference(inner, outer, stacked, range(6), tmp_path, clip=clip, **OPTIONS)
    assert 0 < rolled_back < 6
    assert_close_to_optax(got, expected, (outer, stacked))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16 with fp32 remainder masters, 4 micro-batches"])
def test_a_deferred_update_gives_the_bits_of_the_speculated_one_and_never_redoes(dtype, tmp_path):
    """``clipping="defer"`` stores each layer's grads and updates each layer just before the next forward computes
    with it: the same programs on the same grads, scaled by the same norm, so the same bits as speculating, with
    nothing redone, while the speculation redoes the steps whose clipping fired."""
    bf16 = dtype != "float32"
    outer, stacked = model(jnp.bfloat16 if bf16 else jnp.float32)
    options = dict(OPTIONS, master_dtype=jnp.float32, master_storage="remainder", microbatches=4) if bf16 else OPTIONS
    inner = optax.sgd(1e-2, momentum=0.9)
    clip = 6.0  # fires in some of the steps
    runs = {}
    for clipping in ("speculate", "defer"):
        paths = [tmp_path / clipping]
        with jax_mlp.stream_layers(STACK, inner, max_grad_norm=clip, clipping=clipping, paths=paths, **options) as s:
            runs[clipping], _ = train(s, outer, stacked, range(6))
            runs[clipping, "redone"] = s.rolled_back
    assert 0 < runs["speculate", "redone"] < 6 and runs["defer", "redone"] == 0
    assert_same_bits(runs["defer"], runs["speculate"], f"defer against speculate, {dtype}")


def test_a_deferred_update_waits_in_the_tiers_until_the_next_forward_or_a_flush(tmp_path):
    """After a step the tiers hold the step before it and the grads; the next forward (or anything that reads the
    params, or a save) runs the update first. Each step writes and reads the grads once more than speculating."""
    from jax_mlp._src.cli.streamed import streamed_bytes

    outer, stacked = model()
    options = dict(max_grad_norm=6.0, clipping="defer", subgroup_size="2KiB")
    with jax_mlp.stream_layers(STACK, optax.adam(1e-2), paths=[tmp_path / "tiers"], **options) as stream:
        state = stream.init(outer, stacked)
        records = stream._stream.record_bytes
        subgroups = len(stream.plan.plan.subgroups)
        params_bytes = sum(records[subgroups : 2 * subgroups])
        last_layer = sum(records[subgroups + k] for k in stream.plan.units[-2].subgroups)
        read, write = streamed_bytes(params_bytes, sum(records[:subgroups]), 0, last_layer, params_bytes)
        for step in range(4):
            _, state = stream.step(state, batch_at(step))
            assert int(state.step) == step + 1 and stream.step_count == step  # its update waits
            if step > 1:  # from one commit to the next: a backward, then a forward's update (the first: two forwards)
                stats = stream.stats
                assert (sum(stats.bytes_read.values()), sum(stats.bytes_written.values())) == (read, write), step
        before = stream.params()  # runs the update
        assert stream.step_count == 4
        _, state = stream.step(state, batch_at(4))
    options.pop("clipping")
    with jax_mlp.stream_layers(STACK, optax.adam(1e-2), paths=[tmp_path / "again"], **options) as stream:
        speculated, _ = train(stream, outer, stacked, range(4))
    assert_same_bits(before, speculated, "the deferred update run by params()")


def test_a_deferred_clipping_needs_a_norm_to_wait_for(tmp_path):
    with pytest.raises(jax_mlp.OffloadError, match="clipping='defer' holds each update back"):
        jax_mlp.stream_layers(STACK, optax.adam(1e-2), clipping="defer", paths=[tmp_path])
    with pytest.raises(jax_mlp.OffloadError, match="clipping must be one of 'speculate', 'defer'"):
        jax_mlp.stream_layers(STACK, optax.adam(1e-2), max_grad_norm=1.0, clipping="late", paths=[tmp_path])


def test_against_the_whole_model_in_optax(tmp_path):
    """Per-layer programs against ``jax.grad`` of the whole model and optax in memory: the core tolerance."""
    outer, stacked = model()
    inner = optax.adam(1e-2)
    with jax_mlp.stream_layers(STACK, inner, paths=[tmp_path / "tiers"]) as stream:
        got, _ = train(stream, outer, stacked, range(5))
    assert_close_to_optax(got, whole_model_in_optax(inner, outer, stacked, range(5)), (outer, stacked))


def whole_model_in_optax(inner, outer, stacked, steps):
    """``jax.grad`` of the whole model and optax, in memory: the reference every layer-streamed run is held to."""
    tree = {"layers": unstack(stacked, LAYERS), "outer": outer}
    state = inner.init(tree)
    for step in steps:
        updates, state = jax.jit(inner.update)(jax.grad(STACK.loss)(tree, batch_at(step)), state, tree)
        tree = optax.apply_updates(tree, updates)
    return tree["outer"], stack_layers(tree["layers"])


def test_layers_sharded_over_eight_devices_train_as_the_whole_model_in_optax(tmp_path):
    """FSDP over a process's devices: each layer's params sharded over 8 devices (the layer axis not), the outer
    params sharded or replicated. Each device's shards are records of their own; the forward and the backward
    assemble each layer with its sharding, and the update runs shard by shard on each shard's device."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    outer, stacked = model()
    outer = {
        "embedding": jax.device_put(outer["embedding"], NamedSharding(mesh, P(None, "fsdp"))),
        "out": jax.device_put(outer["out"], NamedSharding(mesh, P())),  # replicated: one owner updates it
    }
    stacked = {
        "w": jax.device_put(stacked["w"], NamedSharding(mesh, P(None, "fsdp"))),
        "b": jax.device_put(stacked["b"], NamedSharding(mesh, P(None, "fsdp"))),
    }
    inner = optax.adam(1e-2)
    with jax_mlp.stream_layers(STACK, inner, paths=[tmp_path / "tiers"]) as stream:
        got, losses = train(stream, outer, stacked, range(5))
        owners = {p.device for sg in stream.plan.plan.subgroups for p in sg.pieces}
        one = stream.unit_params(0)
    assert owners == {d.id for d in mesh.devices.flat}  # every device updates its own shards
    assert one["w"].sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp")), 2)
    assert len(one["w"].addressable_shards) == 8 and one["w"].addressable_shards[0].data.shape == (2, WIDTH)
    assert losses[-1] < losses[0]
    assert_close_to_optax(got, whole_model_in_optax(inner, outer, stacked, range(5)), (outer, stacked))


def test_a_sharded_layer_axis_is_refused_before_anything_is_written(tmp_path):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("layers",))
    outer, stacked = model()
    stacked = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("layers"))), stacked)
    refused = pytest.raises(jax_mlp.OffloadError, match=r"\['b'\] is sharded .* leave the layer axis")
    with jax_mlp.stream_layers(STACK, optax.adam(1e-2), paths=[tmp_path / "tiers"]) as stream, refused:
        stream.init(outer, stacked)
    assert not (tmp_path / "tiers").exists()


def test_a_model_initialised_layer_by_layer_trains_as_the_same_model_given_whole(tmp_path):
    outer, stacked = model()
    inner = optax.adam(1e-2)
    with jax_mlp.stream_layers(STACK, inner, paths=[tmp_path / "a"], **OPTIONS) as stream:
        given, _ = train(stream, outer, stacked, range(3))
    made = []

    def layer_init(index):
        made.append(index)
        return jax.tree.map(lambda x: x[index], stacked)

    with jax_mlp.stream_layers(STACK, inner, paths=[tmp_path / "b"], **OPTIONS) as stream:
        state = stream.init(outer, layer_init=layer_init, num_layers=LAYERS)
        assert sorted(made) == list(range(LAYERS))
        for step in range(3):
            _, state = stream.step(state, batch_at(step))
        assert_same_bits(stream.params(), given, "layer_init against the stacked layers")


def test_a_layer_that_closes_over_an_array_is_refused_before_anything_is_written(tmp_path):
    scale = jnp.ones(WIDTH)

    def scaled(params, x):
        return layer(params, x) * scale

    outer, stacked = model()
    stream = jax_mlp.stream_layers(jax_mlp.LayerStack(embed, scaled, head), optax.adam(1e-2), paths=[tmp_path])
    with stream, pytest.raises(jax_mlp.OffloadError, match=r"closes over arrays \(shapes \(16,\)\)"):
        stream.init(outer, stacked)
    assert not list(tmp_path.iterdir())


def test_layers_of_different_shapes_are_refused(tmp_path):
    outer, stacked = model()
    stacked["b"] = stacked["b"][:3]
    with (
        jax_mlp.stream_layers(STACK, optax.adam(1e-2), paths=[tmp_path]) as stream,
        pytest.raises(jax_mlp.OffloadError, match="stacked on axis 0, one entry per layer"),
    ):
        stream.init(outer, stacked)


def test_bf16_params_stay_within_one_ulp_of_the_in_memory_scheme(tmp_path):
    """bf16 params with fp32 masters in optax against the whole model's grads: the bf16 bound."""
    outer, stacked = model(jnp.bfloat16)
    inner = optax.adam(1e-3)
    options = dict(master_dtype=jnp.float32, master_storage="remainder")
    with jax_mlp.stream_layers(STACK, inner, paths=[tmp_path / "tiers"], **OPTIONS, **options) as stream:
        got, _ = train(stream, outer, stacked, range(3))
    expected = in_memory_reference(inner, outer, stacked, range(3), tmp_path, **OPTIONS, **options)
    assert_bf16_within_ulp(got, expected, "layer-streamed bf16")


CRASH_STEPS, KILLED_AT = 6, 3
CHILD = textwrap.dedent(
    """
    import json, os, signal, sys
    sys.path.insert(0, sys.argv[1])
    import optax
    import jax_mlp
    from jax_mlp._src.storage.paths import PathStore
    from test_layers import STACK, CRASH_OPTIONS, CRASH_STEPS, DEFERRED, KILLED_AT, batch_at, model

    root, point = sys.argv[2], sys.argv[3]
    write, fetch = PathStore.write, PathStore.read
    options = DEFERRED if point == "deferred update" else {}
    stream = jax_mlp.stream_layers(STACK, optax.adam(1e-2), paths=[f"{root}/a", f"{root}/b"], **CRASH_OPTIONS, **options)
    seen = []

    def die(**where):
        with open(f"{root}/killed.json", "w") as f:
            json.dump({"point": point, **where}, f)
        os.kill(os.getpid(), signal.SIGKILL)

    def writing(self, record, slot, data):
        committed = record < 2 * len(stream.plan.plan.subgroups)  # not a deferred update's grads
        if stream.step_count == KILLED_AT and slot == (KILLED_AT + 1) % 2 and point != "forward" and committed:
            seen.append(record)
            if len(seen) == 5:  # a record of step KILLED_AT + 1 half written, others not yet
                torn = data.copy()
                torn[data.nbytes // 2 :] = 0
                write(self, record, slot, torn)
                die(record=record, slot=slot)
        return write(self, record, slot, data)

    def reading(self, record, slot):
        if stream.step_count == KILLED_AT and point == "forward":
            seen.append(record)
            if len(seen) == 3:
                die(record=record)
        return fetch(self, record, slot)

    PathStore.write, PathStore.read = writing, reading
    outer, stacked = model()
    state = stream.init(outer, stacked)
    for step in range(CRASH_STEPS):
        _, state = stream.step(state, batch_at(step))
    print("the kill point was never reached")
    """
)
CRASH_OPTIONS = dict(OPTIONS, host_cache=0)  # every record on the paths once its step is committed
DEFERRED = dict(max_grad_norm=6.0, clipping="defer")


@pytest.mark.parametrize("point", ["forward", "update", "deferred update"])
def test_kill_9_mid_step_resumes_from_the_tiers_bitwise(point, tmp_path):
    """Killed while the forward reads, or with a params record of the next step half written (by the update in the
    backward, or by the deferred one in the next forward): the tiers hold the last committed step's params and
    state, and training resumed from them ends bitwise where it would have (a deferred update's grads, lost, are
    made again by the step run again)."""
    inner = optax.adam(1e-2)
    options = DEFERRED if point == "deferred update" else {}
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(Path(__file__).parent), str(tmp_path), point],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    outer, stacked = model()
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (outer, stacked))
    paths = [tmp_path / "a", tmp_path / "b"]
    with jax_mlp.stream_layers(STACK, inner, paths=paths, resume=True, **CRASH_OPTIONS, **options) as stream:
        state = stream.init(*like)
        assert int(state.step) == KILLED_AT
        for step in range(KILLED_AT, CRASH_STEPS):
            _, state = stream.step(state, batch_at(step))
        resumed = stream.params()
    with jax_mlp.stream_layers(STACK, inner, paths=[tmp_path / "whole"], **CRASH_OPTIONS, **options) as stream:
        uninterrupted, _ = train(stream, outer, stacked, range(CRASH_STEPS))
    assert_same_bits(resumed, uninterrupted, f"killed in the {point}")


def test_each_step_moves_the_bytes_of_the_plan_command_formula(tmp_path):
    """Without a host cache: the forward reads every params record but the outer params' and the first layer's,
    which it takes from the last step's update as it made them (that update's writes run on into it); the
    backward every one but the last layer's (still on the device); the update reads every state record and writes
    both. From one commit to the next (the first holds two forwards), the library's counts are ``jax-mlp plan
    --params-in tiers``'s formula exactly, every step, and each path's are its share within one record."""
    from jax_mlp._src.cli.streamed import streamed_bytes

    outer, stacked = model()
    paths = [jax_mlp.Path(tmp_path / "a", read_bandwidth="2GB/s", write_bandwidth="1GB/s"), tmp_path / "b"]
    with jax_mlp.stream_layers(STACK, optax.adam(1e-2), paths=paths, subgroup_size="2KiB") as stream:
        state = stream.init(outer, stacked)
        records = stream._stream.record_bytes
        subgroups, units = len(stream.plan.plan.subgroups), stream.plan.units
        last_layer = sum(records[subgroups + k] for k in units[-2].subgroups)
        kept = sum(records[subgroups + k] for unit in (units[-1], units[0]) for k in unit.subgroups)
        read, write = streamed_bytes(sum(records[subgroups:]), sum(records[:subgroups]), 0, last_layer, 0, kept)
        shares = stream._stream.scheduler.shares  # the model's best split, as plan computes it
        for step in range(4):
            _, state = stream.step(state, batch_at(step))
            assert int(state.step) == step + 1 and stream.step_count == step  # committed in the next forward
            if step < 2:
                continue
            stats = stream.stats
            assert sum(stats.bytes_read.values()) == read and sum(stats.bytes_written.values()) == write, step
            for path, share in zip(stats.paths, shares, strict=True):
                assert abs(stats.bytes_read[path] - share * read) <= 2 * max(records), (path, step)
                assert abs(stats.bytes_written[path] - share * write) <= max(records), (path, step)
        stream.flush()
        assert stream.step_count == 4


def test_a_host_cache_keeps_the_turnarounds(tmp_path):
    """The last layers the forward reads are the first the backward reads, and the last the update writes the first
    the next forward reads: a cache of a few layers' params saves those reads."""
    outer, stacked = model(layers=8)
    with jax_mlp.stream_layers(STACK, optax.adam(1e-2), paths=[tmp_path], host_cache="8KiB") as stream:
        state = stream.init(outer, stacked)
        records = stream._stream.record_bytes
        subgroups = len(stream.plan.plan.subgroups)
        params_bytes, state_bytes = sum(records[subgroups:]), sum(records[:subgroups])
        for step in range(3):
            _, state = stream.step(state, batch_at(step))
        read = sum(stream.stats.bytes_read.values())
        assert state_bytes <= read < 2 * params_bytes + state_bytes
        assert stream.stats.cache_hits > 0


def _live_device_bytes(kind: str = "device") -> int:
    """Bytes of the live arrays in memory ``kind`` (on CPU, device memory is the live jax arrays)."""
    seen, total = set(), 0
    for array in jax.live_arrays():
        if array.is_deleted():
            continue
        for shard in array.addressable_shards:
            key = (shard.device.id, shard.data.unsafe_buffer_pointer())
            if key not in seen and shard.data.sharding.memory_kind == kind:
                seen.add(key)
                total += shard.data.nbytes
    return total


def test_the_device_holds_a_few_layers_not_the_model(tmp_path, monkeypatch):
    """Live device bytes sampled at every layer program and subgroup program of a step: a few layers' params and
    grads, the update's records in flight and the layers' inputs, never the model."""
    from jax_mlp._src.plan import programs

    layers, width = 32, 128
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    outer = {"embedding": jax.random.normal(keys[0], (VOCAB, width)), "out": jax.random.normal(keys[1], (width, 3))}
    stacked = {"w": jax.random.normal(keys[2], (layers, width, width)) * 0.1, "b": jnp.zeros((layers, width))}
    layer_bytes = 4 * (width * width + width)
    depth = 2
    sampled = []
    run = programs.Executables.__call__
    monkeypatch.setattr(programs.Executables, "__call__", lambda *a: (sampled.append(_live_device_bytes()), run(*a))[1])
    options = dict(subgroup_size="8KiB", prefetch_depth=depth, write_depth=depth)
    with jax_mlp.stream_layers(STACK, optax.adam(1e-2), paths=[tmp_path], **options) as stream:
        state = stream.init(outer, stacked)
        del stacked  # the test's copy of the model
        before = _live_device_bytes()
        sampled.clear()
        _, state = stream.step(state, batch_at(0))
        jax.block_until_ready(state)
    added = max(sampled) - before
    record = max(stream._stream.record_bytes)
    activations = 2 * (layers + 1) * BATCH * width * 4
    # Params of three layers (the one computing, the one read ahead: depth // 2, the one handed to the
    # update), grads of two (computing, handed over), the new params of one being stored; the update's
    # records in flight (fields and new state on the device); the outer unit; the layers' inputs.
    bound = 6 * layer_bytes + 2 * (2 * depth + 2) * record + 2 * 4 * (VOCAB + 3) * width + activations
    print(f"device bytes added during a step: {added}, bound {bound}, model {layers * layer_bytes}")
    assert added <= bound < layers * layer_bytes


def test_layer_inputs_kept_in_host_memory_or_files_leave_the_device_and_change_no_bit(tmp_path, monkeypatch):
    """With ``activations="pinned_host"`` each layer's input waits in host memory between the forward and the
    backward, with a directory in its files: the device holds a few layers' inputs (the one computing, the one
    coming, the one just done), not every layer's, and the params end bit for bit the same."""
    from jax_mlp._src.plan import programs

    layers, batch = 16, 512
    outer, stacked = model(layers=layers)
    input_bytes = batch * WIDTH * 4
    sampled = {"device": [], "pinned_host": []}
    run = programs.Executables.__call__

    def sample(*args):
        for kind, values in sampled.items():
            values.append(_live_device_bytes(kind))
        return run(*args)

    monkeypatch.setattr(programs.Executables, "__call__", sample)
    results, peaks, files = {}, {}, tmp_path / "inputs"
    for kind in ("device", "pinned_host", "files"):
        where = files if kind == "files" else kind
        with jax_mlp.stream_layers(STACK, optax.adam(1e-2), paths=[tmp_path / kind], activations=where) as stream:
            state = stream.init(outer, stacked)
            before = {k: _live_device_bytes(k) for k in sampled}
            for values in sampled.values():
                values.clear()
            for step in range(2):
                _, state = stream.step(state, batch_at(step, batch))
            peaks[kind] = {k: max(values) - before[k] for k, values in sampled.items()}
            results[kind] = stream.params()
            if kind == "files":  # one file per layer's input (a single micro-batch on one device)
                assert len(list((files / "inputs.proc0000").iterdir())) == layers
    assert_same_bits(results["pinned_host"], results["device"], "activations in pinned_host")
    assert_same_bits(results["files"], results["device"], "activations in files")
    assert not any(files.iterdir())  # close removes the inputs' files
    print(f"added bytes during a step, by where the inputs wait: {peaks}; one layer's input {input_bytes}")
    assert peaks["device"]["device"] >= layers * input_bytes
    for kind in ("pinned_host", "files"):
        assert peaks[kind]["device"] <= peaks["device"]["device"] - layers // 2 * input_bytes, kind
    assert peaks["pinned_host"]["pinned_host"] >= (layers - 2) * input_bytes
    assert peaks["files"]["pinned_host"] == 0


def test_a_full_activations_directory_names_the_file_and_commits_nothing(tmp_path):
    """The layers' inputs fill a real tmpfs in the forward: an ``OffloadError`` names the file and says what to do,
    and the tiers keep the step they held, params and state."""
    from helpers import tmpfs

    outer, stacked = model()
    with tmpfs(tmp_path / "small", "512k") as small:
        stream = jax_mlp.stream_layers(STACK, optax.adam(1e-2), paths=[tmp_path / "tiers"], activations=small)
        with stream:
            state = stream.init(outer, stacked)
            with pytest.raises(
                jax_mlp.OffloadError, match=rf"to {small}/inputs.proc0000/\d\.0\.0 failed .*No space left.*free space"
            ):
                stream.step(state, batch_at(0, 4096))  # 256 KiB a layer's input
            assert stream.step_count == 0
            assert_same_bits(stream.params(), (outer, stacked), "the tiers after the failed step")


@pytest.mark.parametrize("when", ["in its step", "after its step returned"])
def test_a_disk_that_fills_while_the_update_writes_names_the_path_and_loses_nothing(when, tmp_path, monkeypatch):
    """A real tmpfs filled by another writer after step 1, while step 2's update writes: in its step (the backward
    handing over learns it), or once the step has returned (its last record held back until the disk is full, as
    the writes run on into the next forward: that forward fails). An ``OffloadError`` names the path and the step
    the tiers hold, and running that step again once there is room ends bitwise where an uninterrupted run does."""
    import threading

    from helpers import tmpfs

    from jax_mlp._src.plan.layers import update_order
    from jax_mlp._src.storage.paths import PathStore

    outer, stacked = model()
    inner = optax.adam(1e-2)
    with jax_mlp.stream_layers(STACK, inner, paths=[tmp_path / "whole"], **CRASH_OPTIONS) as stream:
        uninterrupted, _ = train(stream, outer, stacked, range(4))
    with (
        tmpfs(tmp_path / "small", "4m") as small,
        jax_mlp.stream_layers(STACK, inner, paths=[small], **CRASH_OPTIONS) as stream,
    ):
        _, held = stream.step(stream.init(outer, stacked), batch_at(0))
        stream.flush()
        full = threading.Event()
        if when == "after its step returned":
            last, write = update_order(stream.plan)[-1], PathStore.write

            def held_back(self, record, slot, data):
                if record == last and slot == 0 and not full.is_set():  # step 2's last record
                    assert full.wait(60)
                return write(self, record, slot, data)

            monkeypatch.setattr(PathStore, "write", held_back)
            _, state = stream.step(held, batch_at(1))
        with open(small / "filler", "wb", buffering=0) as filler, contextlib.suppress(OSError):
            while True:
                filler.write(b"\0" * 4096)
        full.set()
        with pytest.raises(jax_mlp.OffloadError, match=rf"path {small} is full.*free space") as raised:
            if when == "in its step":
                _, state = stream.step(held, batch_at(1))
            stream.step(state, batch_at(2))
        if when == "after its step returned":
            assert re.search(
                r"the update of step 2 failed while writing its records .*the tiers hold step 1", str(raised.value)
            )
        assert stream.step_count == 1
        (small / "filler").unlink()
        state = held
        for step in range(1, 4):
            _, state = stream.step(state, batch_at(step))
        assert_same_bits(stream.params(), uninterrupted, f"run again after the disk filled {when}")


def test_activations_elsewhere_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(jax_mlp.OffloadError, match="activations must be one of 'device', 'pinned_host' or a direc"):
        jax_mlp.stream_layers(STACK, optax.adam(1e-2), paths=[tmp_path], activations="disk")
    assert not any(tmp_path.iterdir())
    (tmp_path / "a file").write_text("not a directory")
    outer, stacked = model()
    stream = jax_mlp.stream_layers(STACK, optax.adam(1e-2), paths=[tmp_path / "tiers"], activations=tmp_path / "a file")
    with stream, pytest.raises(jax_mlp.OffloadError, match=r"activations directory .*a file.* cannot be written"):
        stream.init(outer, stacked)
    assert not (tmp_path / "tiers").exists()


def test_a_linen_scan_model_streams_through_the_recipe(tmp_path):
    """A linen ``nn.scan`` stack: its layer is the scanned module applied to one layer's params."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + jnp.tanh(nn.Dense(WIDTH)(x)), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Embed(VOCAB, WIDTH)(x)
            scanned = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)
            x, _ = scanned(name="blocks")(x, None)
            return nn.Dense(3, name="out")(x)

    params = Model().init(jax.random.PRNGKey(0), jnp.zeros((BATCH,), jnp.int32))["params"]
    outer = {"embed": params["Embed_0"], "out": params["out"]}
    stack = jax_mlp.LayerStack(
        embed=lambda o, b: nn.Embed(VOCAB, WIDTH).apply({"params": o["embed"]}, b["tokens"]),
        layer=lambda p, x: Block().apply({"params": p}, x, None)[0],
        head=lambda o, x, b: jnp.mean(jnp.square(nn.Dense(3).apply({"params": o["out"]}, x) - b["targets"])),
    )
    inner = optax.adam(1e-2)
    with jax_mlp.stream_layers(stack, inner, paths=[tmp_path]) as stream:
        state = stream.init(outer, params["blocks"])
        for step in range(3):
            _, state = stream.step(state, batch_at(step))
        got_outer, got_blocks = stream.params()

    def loss(p, b):
        return jnp.mean(jnp.square(Model().apply({"params": p}, b["tokens"]) - b["targets"]))

    expected, opt_state = params, inner.init(params)
    for step in range(3):
        updates, opt_state = inner.update(jax.grad(loss)(expected, batch_at(step)), opt_state, expected)
        expected = optax.apply_updates(expected, updates)
    got = {"Embed_0": got_outer["embed"], "blocks": got_blocks, "out": got_outer["out"]}
    assert_close_to_optax(got, dict(expected), dict(params))


MEMORY_CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    import optax
    import jax_mlp
    from test_layers import STACK, model

    outer, stacked = model()
    with jax_mlp.stream_layers(STACK, optax.adam(1e-2), paths=[sys.argv[2]], host_cache=sys.argv[3]) as stream:
        stream.init(outer, stacked)
    print("initialised")
    """
)


def test_a_memory_cap_below_what_the_run_needs_is_refused_before_anything_is_written(tmp_path):
    """In a real memory cgroup (v1) capped below the run's host cache: the library's error names the cap and what
    the run needs, part by part, up front: neither the kernel's OOM killer nor a record written."""
    group = pathlib.Path("/sys/fs/cgroup/memory") / f"jax_mlp_test_{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(1536 * 2**20))
        script = f'echo $$ > {group / "cgroup.procs"} && exec "$@"'
        command = ["sh", "-c", script, "sh", sys.executable, "-c", MEMORY_CHILD]
        done = subprocess.run(
            [*command, str(Path(__file__).parent), str(tmp_path / "tiers"), "2GiB"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        group.rmdir()
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert re.search(
        r"memory cap \(cgroup\) is 1\.5 GiB, but the layer-streamed run needs about .* host_cache 2\.0 GiB", done.stderr
    )
    assert not (tmp_path / "tiers").exists() or not list((tmp_path / "tiers").rglob("sg*"))
