"""Orbax checkpoints in the standard optax layout: across processes, to and from plain optax, other tiers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import (
    EXACT_BOUND,
    abstract,
    assert_close_to_optax,
    assert_same_bits,
    decay_mask,
    grads_at,
    make_params,
    max_relative_deviation,
    train,
)

import jax_mlp
from jax_mlp._src.offload.offloader import Offloader
from jax_mlp._src.plan import remainders
from jax_mlp._src.storage.paths import PathStore

TESTS = Path(__file__).resolve().parent
OPTIONS = {"subgroup_size": "16KiB", "host_cache": "40KiB"}  # splits "big" into row chunks; a partial cache


# One optimizer object for the module: compiled subgroup updates are cached per object.
INNER = optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask)


def restore(directory, step, opt_args, params_like):
    """Restores params and opt_state with a fresh manager (orbax binds an item to its first handler)."""
    with ocp.CheckpointManager(directory) as manager:
        restored = manager.restore(
            step, args=ocp.args.Composite(params=ocp.args.StandardRestore(params_like), opt_state=opt_args)
        )
    return restored["params"], restored["opt_state"]


CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    import jax, numpy as np, optax, orbax.checkpoint as ocp
    import jax_mlp
    from helpers import abstract, grads_at, make_params, train
    from test_checkpoint import INNER, restore

    root = sys.argv[2]
    like = abstract(make_params())

    def offloaded(directory, step, **options):
        with jax_mlp.mlp_offload(INNER, **options) as tx:
            params, state = restore(directory, 5, jax_mlp.OffloadRestore(tx, like), like)
            assert int(state.step) == step, state
            params, _ = train(tx, params, state, range(5, 10))
        return params

    def plain(directory):
        layout = jax_mlp.standard_layout(INNER, like)
        params, state = restore(directory, 5, ocp.args.StandardRestore(layout), like)
        return train(INNER, params, state, range(5, 10))[0]

    results = {
        "same_plan": offloaded(f"{root}/offloaded", 5, paths=[f"{root}/new"], subgroup_size="16KiB", host_cache="40KiB"),
        "other_plan": offloaded(
            f"{root}/offloaded", 5, paths=[f"{root}/p1", f"{root}/p2", f"{root}/p3"], subgroup_size="8KiB"
        ),
        "into_plain": plain(f"{root}/offloaded"),
        "from_plain": offloaded(f"{root}/plain", 0, paths=[f"{root}/p4"], subgroup_size="16KiB", host_cache="1MiB"),
    }
    leaves = {f"{name}/{i}": np.asarray(x) for name, tree in results.items() for i, x in enumerate(jax.tree.leaves(tree))}
    np.savez(f"{root}/results.npz", **leaves)
    """
)


def test_a_checkpoint_restores_in_a_new_process_bitwise_and_into_and_from_plain_optax(tmp_path):
    params = make_params()
    with (
        jax_mlp.mlp_offload(INNER, paths=[tmp_path / "a", tmp_path / "b"], **OPTIONS) as tx,
        ocp.CheckpointManager(tmp_path / "offloaded") as manager,
    ):
        state = tx.init(params)
        assert any(p.rows is not None for sg in tx.plan.subgroups for p in sg.pieces), "a leaf is split"
        params, state = train(tx, params, state, range(5))
        args = ocp.args.Composite(params=ocp.args.StandardSave(params), opt_state=jax_mlp.OffloadSave(tx))
        manager.save(5, args=args)
        offloaded, _ = train(tx, params, state, range(5, 10))  # while the save streams out

    plain_params = make_params()
    with ocp.CheckpointManager(tmp_path / "plain") as manager:
        plain_params, plain_state = train(INNER, plain_params, INNER.init(plain_params), range(5))
        manager.save(
            5,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(plain_params), opt_state=ocp.args.StandardSave(plain_state)
            ),
        )
        plain, _ = train(INNER, plain_params, plain_state, range(5, 10))

    started = time.perf_counter()
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(TESTS), str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert child.returncode == 0, child.stderr[-4000:]
    print(f"child process: {time.perf_counter() - started:.1f}s")
    with np.load(tmp_path / "results.npz") as saved:
        results = {
            name: jax.tree.unflatten(
                jax.tree.structure(offloaded), [saved[f"{name}/{i}"] for i in range(len(jax.tree.leaves(offloaded)))]
            )
            for name in ("same_plan", "other_plan", "into_plain", "from_plain")
        }
    assert_same_bits(results["same_plan"], offloaded, "restored into the same plan in a new process")
    references = {"other_plan": offloaded, "into_plain": offloaded, "from_plain": plain}
    deviations = {name: assert_close_to_optax(results[name], want, what=name) for name, want in references.items()}
    print("max relative deviation per variant:", deviations)
    moved = max(max_relative_deviation(offloaded, make_params()).values())
    assert moved > 100 * EXACT_BOUND, "training moved the params far more than the tolerance"


@pytest.mark.parametrize("storage", ["remainder", "full"])
def test_master_params_round_trip_and_restore_into_plain_optax(storage, tmp_path, caplog):
    """With bf16 params and fp32 masters, the checkpoint holds both; plain optax continues on the masters.

    Remainders are saved as whole fp32 masters, rebuilt from the params given to the save, and
    restored as remainders again: the continued run is bit for bit the uninterrupted one. The saves
    log no warning of orbax's about ``ArrayMetadata`` (the streamed leaves have none).
    """
    params = make_params(dtype=jnp.bfloat16)
    options = {"subgroup_size": "16KiB", "master_dtype": jnp.float32, "master_storage": storage}
    with (
        jax_mlp.mlp_offload(optax.adam(1e-2), paths=[tmp_path / "a"], **options) as tx,
        ocp.CheckpointManager(tmp_path / "ckpt") as manager,
    ):
        state = tx.init(params)
        params, state = train(tx, params, state, range(5))
        if storage == "remainder":
            with pytest.raises(jax_mlp.OffloadError, match=r"remainders.*OffloadSave\(offload, params\)"):
                jax_mlp.OffloadCheckpointHandler().save(tmp_path / "refused", jax_mlp.OffloadSave(tx))
        saved = jax.tree.map(jnp.copy, params)  # the save copies what it needs: these may change meanwhile
        manager.save(
            5, args=ocp.args.Composite(params=ocp.args.StandardSave(params), opt_state=jax_mlp.OffloadSave(tx, saved))
        )
        offloaded, state = train(tx, params, state, range(5, 10))
        manager.save(10, args=ocp.args.Composite(opt_state=jax_mlp.OffloadSave(tx, offloaded)))
    assert "No jax.Array in TypeHandlerRegistry" not in caplog.text

    like = abstract(params)
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[tmp_path / "b"], **options) as resumed:
        restored, state = restore(tmp_path / "ckpt", 5, jax_mlp.OffloadRestore(resumed, like), like)
        assert_same_bits(train(resumed, restored, state, range(5, 10))[0], offloaded)

    layout = jax_mlp.standard_layout(optax.adam(1e-2), like, jnp.float32)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        at_5 = manager.restore(5, args=ocp.args.Composite(opt_state=ocp.args.StandardRestore(layout)))["opt_state"]
        at_10 = manager.restore(10, args=ocp.args.Composite(opt_state=ocp.args.StandardRestore(layout)))["opt_state"]
    assert jax.tree.leaves(at_5["master"])[0].dtype == np.float32
    words = (lambda m: remainders.split(m)[0]) if storage == "remainder" else (lambda m: m.astype(jnp.bfloat16))
    assert_same_bits(jax.tree.map(lambda m: words(jnp.asarray(m)), at_5["master"]), restored)
    masters, plain_state = jax.tree.map(jnp.asarray, at_5["master"]), at_5["opt_state"]
    for step in range(5, 10):  # the same data: gradients of the bf16 params, up-cast
        grads = jax.tree.map(
            lambda g: g.astype(jnp.float32), grads_at(jax.tree.map(lambda m: m.astype(jnp.bfloat16), masters), step)
        )
        updates, plain_state = optax.adam(1e-2).update(grads, plain_state, masters)
        masters = optax.apply_updates(masters, updates)
    deviation = assert_close_to_optax(masters, at_10["master"])["value"]
    print(f"plain optax on the fp32 masters vs the offloaded masters at step 10: {deviation:.2e}")


def test_a_plain_checkpoint_needs_param_values_to_start_master_params(tmp_path):
    params = make_params(dtype=jnp.bfloat16)
    plain = optax.adam(1e-2).init(jax.tree.map(lambda p: p.astype(jnp.float32), params))
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(0, args=ocp.args.Composite(opt_state=ocp.args.StandardSave(plain)))
    options = {"paths": [tmp_path / "a"], "subgroup_size": "16KiB", "master_dtype": jnp.float32}
    with jax_mlp.mlp_offload(optax.adam(1e-2), master_storage="remainder", **options) as tx:
        with (
            pytest.raises(jax_mlp.OffloadError, match=r"has no master params.*pass the params' values"),
            ocp.CheckpointManager(tmp_path / "ckpt") as manager,
        ):
            manager.restore(0, args=ocp.args.Composite(opt_state=jax_mlp.OffloadRestore(tx, abstract(params))))
        with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
            manager.restore(0, args=ocp.args.Composite(opt_state=jax_mlp.OffloadRestore(tx, params)))
        # The masters started from the params: their remainders are zero. Only the high halves (the
        # params) are not in the tiers, so they cannot give the params back.
        pin = tx.pin()
        assert not any(np.any(m) for sg in tx.plan.subgroups for m in tx.read_pinned(pin, sg.index)[1])
        with pytest.raises(jax_mlp.OffloadError, match=r"remainders.*master_storage='full' to resume"):
            jax_mlp.restore_params(tx, params)


def test_a_checkpoint_of_another_optimizer_or_model_is_refused_with_the_reason(tmp_path):
    params = make_params()
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(
            0, args=ocp.args.Composite(opt_state=ocp.args.StandardSave(optax.sgd(1e-2, momentum=0.9).init(params)))
        )
    with (
        jax_mlp.mlp_offload(optax.adam(1e-2), paths=[tmp_path / "a"]) as tx,
        pytest.raises(jax_mlp.OffloadError, match=r"does not hold the state of this optimizer"),
        ocp.CheckpointManager(tmp_path / "ckpt") as manager,
    ):
        manager.restore(0, args=ocp.args.Composite(opt_state=jax_mlp.OffloadRestore(tx, params)))
    other = dict(params, embed=jnp.zeros((41, 16)))
    with (
        jax_mlp.mlp_offload(optax.sgd(1e-2, momentum=0.9), paths=[tmp_path / "b"]) as tx,
        pytest.raises(jax_mlp.OffloadError, match=r"\['embed'\] with shape \(40, 16\).*need \(41, 16\)"),
        ocp.CheckpointManager(tmp_path / "ckpt") as manager,
    ):
        manager.restore(0, args=ocp.args.Composite(opt_state=jax_mlp.OffloadRestore(tx, other)))


def test_an_async_save_runs_beside_training_and_holds_exactly_its_step(tmp_path, monkeypatch):
    """Only writes that would overwrite a record the save has not read yet wait for it."""
    params = make_params()
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[tmp_path / "a"], subgroup_size="16KiB") as tx:
        state = tx.init(params)
        params, state = train(tx, params, state, range(3))
        num_subgroups = len(tx.plan.subgroups)
        read_done, writes = {}, []
        original_read, original_write = Offloader.read_pinned, PathStore.write

        def slow_read(self, pin, index):
            time.sleep(0.1)  # a slow save: 24 records on 2 reader threads take 1.2 s or more
            result = original_read(self, pin, index)
            read_done[index] = time.perf_counter()
            return result

        def logged_write(self, subgroup, slot, record):
            writes.append((subgroup, slot, time.perf_counter()))
            return original_write(self, subgroup, slot, record)

        monkeypatch.setattr(Offloader, "read_pinned", slow_read)
        monkeypatch.setattr(PathStore, "write", logged_write)
        with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
            save_started = time.perf_counter()
            manager.save(
                3, args=ocp.args.Composite(params=ocp.args.StandardSave(params), opt_state=jax_mlp.OffloadSave(tx))
            )
            blocking = time.perf_counter() - save_started
            params_3 = params
            started = time.perf_counter()
            params, state = train(tx, params, state, [3])  # writes the other slot: must not wait
            free_update = time.perf_counter() - started
            started = time.perf_counter()
            params, state = train(tx, params, state, [4])  # overwrites step 3's slot: waits per record
            pinned_update = time.perf_counter() - started
            manager.wait_until_finished()
        save_seconds = max(read_done.values()) - save_started
        print(
            f"save of {num_subgroups} slowed reads: blocking {blocking * 1e3:.0f} ms, update beside it "
            f"{free_update * 1e3:.0f} ms, the next one {pinned_update * 1e3:.0f} ms, save reading {save_seconds:.2f} s"
        )
        assert blocking < 0.25 * save_seconds
        step_4_writes = [at for _, slot, at in writes if slot == 4 % 2]
        assert step_4_writes and max(step_4_writes) < save_started + save_seconds, "the next update waited for the save"
        step_5_writes = {subgroup: at for subgroup, slot, at in writes if slot == 5 % 2}
        assert len(step_5_writes) == num_subgroups
        assert all(step_5_writes[k] >= read_done[k] for k in range(num_subgroups)), "a pinned record was overwritten"
        monkeypatch.undo()
        expected, _ = train(tx, params, state, range(5, 8))

    like = abstract(params_3)
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[tmp_path / "b"], subgroup_size="16KiB") as resumed:
        restored, state = restore(tmp_path / "ckpt", 3, jax_mlp.OffloadRestore(resumed, like), like)
        assert int(state.step) == 3
        assert_same_bits(train(resumed, restored, state, range(3, 8))[0], expected)


MEMORY = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, optax, orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_mlp
    sys.path.insert(0, sys.argv[2])
    from rss import PeakRise

    def rise(action):
        with PeakRise() as peak:
            result = action()
        return peak.rise, result

    root = sys.argv[1]
    n = 64 * 1024**2  # 64M float32 params: 256 MiB; adam state: 512 MiB
    params = {"w": jnp.ones((n // 1024, 1024), jnp.float32), "b": jnp.zeros((1024,), jnp.float32)}
    if sys.argv[3] == "sharded":  # FSDP over 4 devices of a 2x4 mesh, replicated over 2; "b" replicated on all 8
        mesh = jax.make_mesh((2, 4), ("replica", "fsdp"), devices=jax.devices()[:8])
        params = {"w": jax.device_put(params["w"], NamedSharding(mesh, P("fsdp"))),
                  "b": jax.device_put(params["b"], NamedSharding(mesh, P()))}
    options = {"host_cache": "32MiB", "subgroup_size": "8MiB"}
    tx = jax_mlp.mlp_offload(optax.adam(1e-3), paths=[f"{root}/tier"], **options)
    state = tx.init(params)
    updates = []
    for step in range(2):
        grads = jax.tree.map(lambda p: p * 0.01 + step, params)
        jax.block_until_ready(grads)
        grown, (u, state) = rise(lambda: tx.update(grads, state, params))
        updates.append(grown)
        del u, grads
    manager = ocp.CheckpointManager(f"{root}/ckpt")
    def save():
        manager.save(2, args=ocp.args.Composite(opt_state=jax_mlp.OffloadSave(tx)))
        manager.wait_until_finished()
    save_rise, _ = rise(save)
    tx.close(delete=True)
    fresh = jax_mlp.mlp_offload(optax.adam(1e-3), paths=[f"{root}/other"], **options)
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
    restore_rise, restored = rise(
        lambda: manager.restore(2, args=ocp.args.Composite(opt_state=jax_mlp.OffloadRestore(fresh, like)))
    )
    assert int(restored["opt_state"].step) == 2
    pieces = [p for sg in fresh.plan.subgroups for p in sg.pieces]
    assert any(p.shard is not None for p in pieces) == (sys.argv[3] == "sharded")
    print(json.dumps({"updates": updates, "save": save_rise, "restore": restore_rise,
                      "state_bytes": fresh.plan.state_nbytes}))
    fresh.close(delete=True)
    """
)


@pytest.mark.parametrize("placement", ["one_device", "sharded"])
def test_peak_memory_of_save_and_restore_stays_within_the_bound_of_update(tmp_path, placement):
    """On one device, and sharded on a 2x4 mesh of fake devices (which conftest gives the child too)."""
    result = subprocess.run(
        [sys.executable, "-c", MEMORY, str(tmp_path), str(Path(__file__).parent), placement],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    print(
        "RSS rises (MiB):", {k: v / 2**20 if isinstance(v, int) else [x / 2**20 for x in v] for k, v in figures.items()}
    )
    params_bytes = 64 * 1024**2 * 4
    bound = params_bytes + 256 * 1024**2  # the documented bound of update (tests/test_memory.py)
    assert figures["state_bytes"] >= 2 * params_bytes
    for action in ("save", "restore"):
        assert figures[action] < min(bound, max(figures["updates"])), (action, figures)
        assert figures[action] < figures["state_bytes"] / 2, (action, figures)


def test_a_restore_onto_this_runs_paths_replaces_their_state_and_another_run_is_refused(tmp_path):
    params, paths = make_params(), [tmp_path / "a", tmp_path / "b"]
    with jax_mlp.mlp_offload(INNER, paths=paths, **OPTIONS) as tx:
        trained, state = train(tx, params, tx.init(params), range(3))
        with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
            manager.save(
                3, args=ocp.args.Composite(params=ocp.args.StandardSave(trained), opt_state=jax_mlp.OffloadSave(tx))
            )
        train(tx, trained, state, range(3, 5))
    # Closed: the tiers hold step 5, the checkpoint step 3.

    with jax_mlp.mlp_offload(INNER, paths=paths, **OPTIONS) as tx:
        with pytest.warns(UserWarning, match=r"hold this run's offloaded state up to step 5: that state is discarded"):
            _, state = restore(tmp_path / "ckpt", 3, jax_mlp.OffloadRestore(tx, abstract(params)), abstract(params))
        assert int(state.step) == 3
    # The other slot's records of step 4 are gone with the rest: the tiers resume at the restored step.
    with jax_mlp.mlp_offload(INNER, paths=paths, resume=True, **OPTIONS) as resumed:
        assert int(resumed.init(params).step) == 3

    with (
        jax_mlp.mlp_offload(INNER, paths=paths, **dict(OPTIONS, subgroup_size="8KiB")) as other,
        pytest.raises(jax_mlp.RecordError, match=r"its subgroup_size is 16384, this offload's 8192.*or delete"),
    ):
        restore(tmp_path / "ckpt", 3, jax_mlp.OffloadRestore(other, abstract(params)), abstract(params))
