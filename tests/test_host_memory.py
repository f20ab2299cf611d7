"""Params and grads in host memory (``pinned_host``): the bits of device memory, results where they came from.

Each test trains the same params twice, once kept in ``pinned_host`` and once in device memory, with
the same ``mlp_offload``; the two must be the same bits (the subgroup programs run on device copies
of the host blocks), and within the exactness contract of plain optax. Device memory during an update
is read from the live arrays per memory kind, and the refusals are checked to say what to do.
"""

from __future__ import annotations

import collections

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import (
    SHAPES,
    assert_bf16_within_ulp,
    assert_close_to_optax,
    assert_same_bits,
    decay_mask,
    grads_at,
    make_params,
    run_optax,
)
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jax_mlp
from jax_mlp._src.plan import partition, programs

HOST, DEVICE = "pinned_host", "device"
STEPS = 6
SUBGROUP = "16KiB"  # many subgroups, and the 256x160 leaf cut into row chunks
# JAX computes on 0-d arrays in device memory (optax.apply_updates moves a scalar there), so the trees
# trained with update + apply_updates have no scalar leaf; test_a_scalar_moved_... covers that case.
LEAF_SHAPES = {name: shape for name, shape in SHAPES.items() if shape != ()}


def inner() -> optax.GradientTransformation:
    return optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask)


def mesh_2x4() -> jax.sharding.Mesh:
    """8 of the 9 fake devices: FSDP over 4 and 2 replicas, so assembling copies replicas as well."""
    return jax.make_mesh((2, 4), ("replica", "fsdp"), devices=jax.devices()[:8])


def sharding_of(x: jax.Array, kind: str, mesh: jax.sharding.Mesh | None) -> jax.sharding.Sharding:
    """Device 0 without a mesh; else the largest axis that 4 divides over 'fsdp', replicated over 'replica'."""
    if mesh is None:
        return SingleDeviceSharding(jax.devices()[0], memory_kind=kind)
    axes = [axis for axis in range(x.ndim) if x.shape[axis] % 4 == 0]
    spec = P() if not axes else P(*("fsdp" if axis == axes[0] else None for axis in range(x.ndim)))
    return NamedSharding(mesh, spec, memory_kind=kind)


def placed(tree, kind: str, mesh=None):
    """``tree``'s values (from any memory) in memory ``kind``, placed by :func:`sharding_of`."""
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x), sharding_of(x, kind, mesh)), tree)


def kinds(tree) -> set[str]:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def train(kind, paths, *, apply=False, dtype=jnp.float32, master=None, mesh=None, steps=STEPS):
    """Trains ``LEAF_SHAPES`` params kept in memory ``kind`` with mlp_offload; checks every result's kind on the way."""
    params = placed(make_params(LEAF_SHAPES, dtype=dtype), kind, mesh)
    shardings = [x.sharding for x in jax.tree.leaves(params)]
    results = []  # each step's updates (or, applied, new params): all in memory ``kind``
    with jax_mlp.mlp_offload(inner(), paths=paths, subgroup_size=SUBGROUP, master_dtype=master) as tx:
        grads_of = lambda p, step: placed(grads_at(p, step), kind, mesh)  # noqa: E731
        params, _ = helpers.train(
            tx, params, tx.init(params), range(steps), apply=apply, history=results, grads_of=grads_of
        )
        plan = tx.plan
    assert all(kinds(result) == {kind} for result in results), [jax.tree.map(memory_kind, r) for r in results]
    for x, sharding in zip(jax.tree.leaves(params), shardings, strict=True):
        assert x.sharding.is_equivalent_to(sharding, x.ndim), (x.sharding, sharding)
    assert any(p.rows is not None for sg in plan.subgroups for p in sg.pieces), "no leaf was cut into row chunks"
    return params


def memory_kind(x) -> str:
    return x.sharding.memory_kind


@pytest.mark.parametrize("sharded", [False, True], ids=["one_device", "mesh_2x4"])
@pytest.mark.parametrize("apply", [False, True], ids=["update", "apply"])
def test_host_params_train_bitwise_as_device_params_and_as_optax(sharded, apply, tmp_path):
    mesh = mesh_2x4() if sharded else None
    host = train(HOST, [tmp_path / "host"], apply=apply, mesh=mesh)
    device = train(DEVICE, [tmp_path / "device"], apply=apply, mesh=mesh)
    assert_same_bits(host, device, "params in pinned_host against params in device memory")
    start = make_params(LEAF_SHAPES)
    assert_close_to_optax(host, run_optax(inner(), start, STEPS, jit=True), start)


@pytest.mark.parametrize("apply", [False, True], ids=["update", "apply"])
def test_bf16_host_params_with_fp32_masters_train_bitwise_as_device_params(apply, tmp_path):
    host = train(HOST, [tmp_path / "host"], apply=apply, dtype=jnp.bfloat16, master=jnp.float32)
    device = train(DEVICE, [tmp_path / "device"], apply=apply, dtype=jnp.bfloat16, master=jnp.float32)
    assert_same_bits(host, device, "bf16 params in pinned_host against device memory")
    master = jax.tree.map(lambda p: p.astype(jnp.float32), make_params(LEAF_SHAPES, dtype=jnp.bfloat16))
    state, update = inner().init(master), jax.jit(inner().update)
    for step in range(STEPS):
        grads = grads_at(jax.tree.map(lambda m: m.astype(jnp.bfloat16), master), step)
        updates, state = update(jax.tree.map(lambda g: g.astype(jnp.float32), grads), state, master)
        master = optax.apply_updates(master, updates)
    assert_bf16_within_ulp(
        host, jax.tree.map(lambda m: m.astype(jnp.bfloat16), master), "against fp32 masters in memory"
    )


def test_apply_to_keeps_an_nnx_models_params_in_host_memory(tmp_path):
    from flax import nnx

    def model_in(kind: str) -> nnx.Module:
        model = nnx.Sequential(nnx.Linear(16, 64, rngs=nnx.Rngs(0)), nnx.Linear(64, 8, rngs=nnx.Rngs(1)))
        nnx.update(model, placed(nnx.state(model, nnx.Param), kind))
        return model

    results = {}
    for kind in (HOST, DEVICE):
        model = model_in(kind)
        with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[tmp_path / kind], subgroup_size="4KiB") as tx:
            state = tx.init(nnx.state(model, nnx.Param))
            for step in range(3):
                state = tx.apply_to(model, placed(grads_at(nnx.state(model, nnx.Param), step), kind), state)
        results[kind] = nnx.state(model, nnx.Param)
        assert kinds(results[kind]) == {kind}
    assert_same_bits(results[HOST], results[DEVICE], "an NNX model's params in pinned_host against device memory")


def test_checkpoint_round_trip_keeps_the_memory_kind_of_params_like(tmp_path):
    """Save at step 3, restore into a new offload on other paths, go on: the bits of an uninterrupted run."""
    mesh = mesh_2x4()
    options = dict(subgroup_size=SUBGROUP, master_dtype=jnp.float32)
    params = placed(make_params(LEAF_SHAPES, dtype=jnp.bfloat16), HOST, mesh)
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
    checkpointer = ocp.Checkpointer(jax_mlp.OffloadCheckpointHandler())
    grads_of = lambda p, step: placed(grads_at(p, step), HOST, mesh)  # noqa: E731
    with jax_mlp.mlp_offload(inner(), paths=[tmp_path / "first"], **options) as tx:
        state = tx.init(params)
        params, state = helpers.train(tx, params, state, range(3), apply=True, grads_of=grads_of)
        checkpointer.save(tmp_path / "checkpoint", args=jax_mlp.OffloadSave(tx))
        saved = placed(params, HOST, mesh)  # a copy: apply consumes the params
        params, state = helpers.train(tx, params, state, range(3, STEPS), apply=True, grads_of=grads_of)

    with jax_mlp.mlp_offload(inner(), paths=[tmp_path / "second"], **options) as restored:
        state = checkpointer.restore(tmp_path / "checkpoint", args=jax_mlp.OffloadRestore(restored, like))
        updates = []
        resumed, state = helpers.train(restored, saved, state, range(3, STEPS), history=updates, grads_of=grads_of)
        assert all(kinds(u) == {HOST} for u in updates) and kinds(resumed) == {HOST}
        assert_same_bits(resumed, params, "restored at step 3 against uninterrupted")
        for kind in (HOST, DEVICE):  # from the masters in the tiers, in the memory kind of params_like
            like_kind = jax.tree.map(
                lambda x, k=kind: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding.with_memory_kind(k)), like
            )
            from_tiers = jax_mlp.restore_params(restored, like_kind)
            assert kinds(from_tiers) == {kind}
            assert_same_bits(from_tiers, params, f"restore_params into {kind}")


def _live_bytes() -> collections.Counter:
    """Bytes of live arrays per memory kind; each buffer once (a shard's view shares its array's buffer)."""
    seen, by_kind = set(), collections.Counter()
    for array in jax.live_arrays():
        if array.is_deleted():
            continue
        for shard in array.addressable_shards:
            key = (shard.device.id, shard.data.unsafe_buffer_pointer())
            if key not in seen:
                seen.add(key)
                by_kind[shard.data.sharding.memory_kind] += shard.data.nbytes
    return by_kind


@pytest.mark.parametrize("apply", [False, True], ids=["update", "apply"])
def test_an_update_of_host_params_adds_to_device_memory_only_the_subgroups_in_flight(apply, monkeypatch, tmp_path):
    """Before every subgroup program, the device holds at most the records and blocks in flight, never the tree.

    The bound is what docs/architecture.md ("Memory bounds") promises: ``prefetch_depth + write_depth + 2``
    subgroups, each its record and its blocks (grads, params, results), plus the one leaf cut into row
    chunks whose blocks stay on the device from its first chunk to its last. The same update of params
    in device memory holds the whole tree of updates there, which the same count sees above the bound.
    """
    depth = 2
    shapes = {"layers": [(64, 128)] * 128, "split": (512, 128)}  # 128 x 32 KiB, and a 256 KiB leaf in row chunks
    sampled = []
    run = programs.Executables.__call__
    monkeypatch.setattr(programs.Executables, "__call__", lambda *a: (sampled.append(_live_bytes()), run(*a))[1])

    def peak_added(kind: str) -> tuple[int, collections.Counter, jax_mlp.OffloadTransformation]:
        """The device bytes the update adds at its peak; the host bytes of this test's arrays before it; the offload.

        Host bytes are counted from what was live before this test made its params: arrays of earlier tests
        in the process (held by their frames or caches) are not this update's."""
        existing = _live_bytes()
        params = placed(make_params(shapes), kind)
        grads = placed(grads_at(params, 0), kind)
        options = dict(subgroup_size="64KiB", prefetch_depth=depth, write_depth=depth)
        with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[tmp_path / kind], **options) as tx:
            state = tx.init(params)
            before = _live_bytes()
            sampled.clear()
            result = tx.apply(grads, state, params)[0] if apply else tx.update(grads, state, params)[0]
            assert kinds(result) == {kind}
        sampled[:] = [s - existing for s in sampled]
        return max(s[DEVICE] for s in sampled) - (before - existing)[DEVICE], before - existing, tx

    added, before, offloader = peak_added(HOST)
    plan = offloader.plan
    tree_bytes = sum(4 * np.prod(spec.shape) for spec in plan.leaves)
    assert before[HOST] == 2 * tree_bytes and min(s[HOST] for s in sampled) >= tree_bytes  # params and grads stay
    blocks = max(
        3 * sum(4 * np.prod(partition.piece_shape(plan.leaves[p.leaf], p)) for p in sg.pieces) for sg in plan.subgroups
    )
    record = max(sg.layout.nbytes for sg in plan.subgroups)
    split = 3 * 4 * np.prod(shapes["split"])  # its grads, params and updates, whole, while its chunks run
    bound = (2 * depth + 2) * (record + blocks) + split
    print(f"device memory added: {added} B with params in pinned_host, bound {bound} B, params {tree_bytes} B")
    assert added <= bound < tree_bytes
    if not apply:  # the updates of params in device memory pile up there: the count sees a tree
        assert peak_added(DEVICE)[0] > bound


def test_params_and_grads_in_different_memory_kinds_are_refused_with_what_to_do(tmp_path):
    params = placed(make_params(LEAF_SHAPES), HOST)
    with jax_mlp.mlp_offload(inner(), paths=[tmp_path], subgroup_size=SUBGROUP) as tx:
        state = tx.init(params)
        on_device = placed(grads_at(params, 0), DEVICE)
        with pytest.raises(
            jax_mlp.OffloadError, match=r"grads leaf \['big'\] is in device memory, but params leaf"
        ) as error:
            tx.update(on_device, state, params)
        assert "out_shardings" in str(error.value) and "share one memory kind" in str(error.value)
        with pytest.raises(jax_mlp.OffloadError, match="share one memory kind"):
            tx.apply(on_device, state, params)
        with pytest.raises(
            jax_mlp.OffloadError,
            match=r"params and grads leaf \['big'\] is in device memory, but the params were in pinned_host at init",
        ):
            tx.update(on_device, state, placed(params, DEVICE))
        updates, state = tx.update(placed(grads_at(params, 0), HOST), state, params)  # nothing was read or written
        assert int(state.step) == 1 and kinds(updates) == {HOST}
    with jax_mlp.mlp_offload(optax.sgd(0.1), paths=[tmp_path / "sgd"]) as without_params:  # sgd takes no params
        state = without_params.init(params)
        with pytest.raises(
            jax_mlp.OffloadError, match=r"grads leaf \['big'\] is in device memory, but the params were in pinned_host"
        ):
            without_params.update(on_device, state, None)


def test_a_scalar_moved_to_device_memory_by_apply_updates_is_refused_with_the_remedy(tmp_path):
    params = placed({"w": np.ones((8, 4), np.float32), "t": np.float32(2.0)}, HOST)
    with jax_mlp.mlp_offload(optax.sgd(0.1), paths=[tmp_path]) as tx:
        state = tx.init(params)
        updates, state = tx.update(
            placed({"w": np.ones((8, 4), np.float32), "t": np.float32(1.0)}, HOST), state, params
        )
        params = optax.apply_updates(params, updates)
        assert params["t"].sharding.memory_kind == DEVICE and params["w"].sharding.memory_kind == HOST  # JAX's doing
        with pytest.raises(
            jax_mlp.OffloadError,
            match=r"params and grads leaf \['t'\] .* use tx.apply, or jax.jit\(optax.apply_updates",
        ):
            tx.update(placed(updates, DEVICE), state, params)


def test_unpinned_host_params_are_refused_at_init(tmp_path):
    params = placed({"w": np.ones((8, 4), np.float32)}, "unpinned_host")
    with (
        jax_mlp.mlp_offload(optax.adam(0.1), paths=[tmp_path]) as tx,
        pytest.raises(
            jax_mlp.OffloadError,
            match=r"param leaf \['w'\] is in unpinned_host memory.*with_memory_kind\('pinned_host'\)",
        ),
    ):
        tx.init(params)
    assert not (tmp_path / "proc0000" / "run.json").exists()


def test_host_params_with_accumulation_or_inside_jit_are_refused_with_what_to_do(tmp_path):
    params = placed({"w": np.ones((8, 4), np.float32)}, HOST)
    with (
        jax_mlp.mlp_offload(optax.adam(0.1), paths=[tmp_path / "a"], accumulate_steps=2) as accumulating,
        pytest.raises(
            jax_mlp.OffloadError,
            match=r"accumulate_steps=2.*Accumulate the micro-batches' gradients in your jitted step",
        ),
    ):
        accumulating.init(params)
    with jax_mlp.mlp_offload(optax.adam(0.1), paths=[tmp_path / "b"]) as tx:
        state = tx.init(params)
        step = jax.jit(lambda g, s, p: tx.update(g, s, p), out_shardings=None)
        with pytest.raises(
            jax_mlp.OffloadError, match=r"param \['w'\] is in pinned_host memory; update inside jit .* eagerly"
        ):
            step(params, state, params)
