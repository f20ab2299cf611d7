"""Bytes moved match the plan; bad input and failed I/O give clear errors and lose nothing."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_close_to_optax, assert_same_bits, grads_at, make_params, run_offload

import jax_mlp
from jax_mlp._src.config import total_memory
from jax_mlp._src.plan import partition
from jax_mlp._src.storage import record
from jax_mlp._src.storage.paths import PathStore
from jax_mlp._src.storage.record import HEADER_SIZE

SUBGROUP = "16KiB"


def record_bytes(tx) -> int:
    return sum(HEADER_SIZE + sg.layout.nbytes for sg in tx.offloader.plan.subgroups)


def test_without_cache_each_record_is_read_and_written_once_per_update(paths):
    params = make_params()
    tx = jax_mlp.mlp_offload(optax.adam(1e-2), paths=paths[:2], subgroup_size=SUBGROUP, host_cache=0)
    state = tx.init(params)
    assert sum(tx.stats.bytes_written.values()) == record_bytes(tx)
    for step in range(2):
        _, state = tx.update(grads_at(params, step), state, params)
        stats = tx.stats
        assert stats.cache_hits == 0
        assert stats.cache_misses == len(tx.offloader.plan.subgroups)
        assert sum(stats.bytes_read.values()) == record_bytes(tx)
        assert sum(stats.bytes_written.values()) == record_bytes(tx)
        assert all(v > 0 for v in stats.bytes_read.values()), "both paths are used"
    tx.close()


def test_with_a_cache_larger_than_the_state_the_second_update_reads_nothing(paths):
    params = make_params()
    tx = jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP, host_cache="64MiB")
    state = tx.init(params)
    for step in range(2):
        _, state = tx.update(grads_at(params, step), state, params)
    assert sum(tx.stats.bytes_read.values()) == 0
    assert tx.stats.cache_hits == len(tx.offloader.plan.subgroups)
    tx.flush()
    tx.close()


def test_a_partial_cache_is_reused_by_the_alternating_order(paths):
    params = make_params()
    plan = partition.make_plan(params, optax.adam(1e-2), jax_mlp.parse_size(SUBGROUP))
    third = sum(HEADER_SIZE + sg.layout.nbytes for sg in plan.subgroups) // 3
    tx = jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[1]], subgroup_size=SUBGROUP, host_cache=third)
    state = tx.init(params)
    for step in range(3):
        _, state = tx.update(grads_at(params, step), state, params)
        assert tx.stats.cache_hits >= 1
        assert tx.stats.cache_hits + tx.stats.cache_misses == len(plan.subgroups)
    tx.close()


def test_mismatched_grads_tree_names_the_leaf(paths):
    params = make_params()
    tx = jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP)
    state = tx.init(params)
    grads = grads_at(params, 0)
    missing = dict(grads)
    del missing["temperature"]
    with pytest.raises(jax_mlp.OffloadError, match=r"grads tree does not match.*\['temperature'\]"):
        tx.update(missing, state, params)
    reshaped = dict(grads, head=dict(grads["head"], w=jnp.zeros((10, 16))))
    with pytest.raises(jax_mlp.OffloadError, match=r"grads leaf \['head'\]\['w'\] has shape \(10, 16\).*\(16, 10\)"):
        tx.update(reshaped, state, params)
    retyped = dict(params, embed=params["embed"].astype(jnp.bfloat16))
    with pytest.raises(jax_mlp.OffloadError, match=r"params leaf \['embed'\] has dtype bfloat16.*float32"):
        tx.update(grads, state, retyped)
    _updates, state = tx.update(grads, state, params)  # nothing was lost: the same update still works
    assert int(state.step) == 1
    tx.close()


def _refused(call, match: str) -> None:
    """``call`` raises an OffloadError matching ``match``, which is also a ValueError."""
    with pytest.raises(jax_mlp.OffloadError, match=match) as caught:
        call()
    assert isinstance(caught.value, ValueError)


def test_bad_input_raises_an_offload_error_that_is_a_value_error_and_says_what_to_do(paths):
    """One ``except jax_mlp.OffloadError`` catches every refusal of bad input; ``except ValueError`` still does."""
    _refused(
        lambda: jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=0),
        r"subgroup_size must be positive, got 0: give the bytes of state to stream at once",
    )
    _refused(lambda: jax_mlp.quantized_state(optax.adam(1e-2), "fp8"), r"codec 'fp8' is not one of .*: pass one of")
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]]) as tx:
        _refused(lambda: tx.init({}), r"params has no leaves, so there is no optimizer state to offload: pass")
    params = {"w": jnp.ones((4, 8)), "b": jnp.ones(8)}
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[1]]) as tx:
        state = tx.init(params)
        _refused(lambda: tx.update({"w": params["w"]}, state, params), r"missing leaves \[\"\['b'\]\"\]\. Pass grads")
        _refused(
            lambda: tx.update(dict(params, b=jnp.arange(8)), state, params),
            r"grads leaf \['b'\] has dtype int32, but only floating-point leaves can be optimized: cast it",
        )
    devices = jax.devices()[:2]  # each leaf whole on another device: no one mesh to map the update over
    spread = {"w": jax.device_put(params["w"], devices[0]), "b": jax.device_put(params["b"], devices[1])}
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[2]]) as tx:
        state = tx.init(spread)
        _refused(lambda: jax.jit(tx.update)(spread, state, spread), r"several devices, .*call tx.update outside jit")


def test_paths_that_cannot_be_used_are_named(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    params = make_params()
    with pytest.raises(jax_mlp.PathError, match=f"path {blocker}/sub cannot be created"):
        jax_mlp.mlp_offload(optax.adam(1e-2), paths=[blocker / "sub"]).init(params)
    with pytest.raises(jax_mlp.PathError, match="path /sys is not writable"):
        jax_mlp.mlp_offload(optax.adam(1e-2), paths=["/sys"]).init(params)
    with pytest.raises(jax_mlp.OffloadError, match="is given twice"):
        jax_mlp.mlp_offload(optax.adam(1e-2), paths=[tmp_path / "x", str(tmp_path / "x") + "/"])
    with pytest.raises(jax_mlp.OffloadError, match="host_cache='lots' is not a size"):
        jax_mlp.mlp_offload(optax.adam(1e-2), paths=[tmp_path / "y"], host_cache="lots")


def test_sizes_accept_human_units():
    assert jax_mlp.parse_size("256MiB") == 256 * 1024**2
    assert jax_mlp.parse_size("1.5GB") == 1_500_000_000
    assert jax_mlp.parse_size(4096) == 4096
    assert jax_mlp.parse_size("0") == 0


def test_init_under_jit_says_to_call_it_eagerly(paths):
    tx = jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP)
    with pytest.raises(jax_mlp.OffloadError, match="call init eagerly"):
        jax.jit(tx.init)(make_params())
    tx.close()


def test_a_stale_opt_state_is_refused(paths):
    params = make_params()
    tx = jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP)
    first = tx.init(params)
    _, _second = tx.update(grads_at(params, 0), first, params)
    with pytest.raises(jax_mlp.OffloadError, match="at step 0, but the offloaded state is at step 1"):
        tx.update(grads_at(params, 1), first, params)
    tx.close()


def test_a_second_run_on_the_same_directory_names_both_ways_on(paths):
    params = make_params()
    run_offload(optax.adam(1e-2), params, 3, [paths[0]], subgroup_size=SUBGROUP)
    with pytest.raises(jax_mlp.OffloadError) as refused:
        jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP).init(params)
    message = str(refused.value)
    assert f"path {paths[0]} already holds this run's offloaded optimizer state" in message
    assert "newest record is of step 3" in message
    assert "resume=True" in message and "OffloadRestore" in message
    # Nothing was written: the run resumes at its step.
    assert (
        int(
            jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP, resume=True)
            .init(params)
            .step
        )
        == 3
    )


def _refusal(paths, params, inner=None, **options):
    options = {"subgroup_size": SUBGROUP, **options}
    with pytest.raises(jax_mlp.RecordError, match="another run or subgroup layout") as refused:
        jax_mlp.mlp_offload(inner or optax.adam(1e-2), paths=[paths[0]], **options).init(params)
    return str(refused.value)


def test_a_run_of_another_layout_is_refused_naming_what_changed(paths):
    params = dict(make_params(), embed=make_params()["embed"].astype(jnp.bfloat16))  # mixed: a master is allowed
    run_offload(optax.adam(1e-2), params, 1, [paths[0]], subgroup_size=SUBGROUP)
    fp32 = dict(params, embed=params["embed"].astype(jnp.float32))
    assert "param leaf 0 is ['big'] float32[256, 160] there, ['big'] bfloat16[256, 160] here" in _refusal(
        paths, dict(params, big=params["big"].astype(jnp.bfloat16)), resume=True
    )
    assert "['embed'] bfloat16[40, 16] there, ['embed'] float32[40, 16] here" in _refusal(paths, fp32, resume=True)
    assert "its subgroup_size is 16384, this offload's 8192" in _refusal(
        paths, params, subgroup_size="8KiB", resume=True
    )
    assert "its master_dtype is None, this offload's float32" in _refusal(
        paths, params, master_dtype=jnp.float32, resume=True
    )
    changed = _refusal(paths, params, optax.sgd(1e-2, momentum=0.9), resume=True)
    assert "subgroup 0's state field 0 is [0].count int32[] there" in changed and "another optimizer" in changed
    assert "resume with the params, optimizer, subgroup_size and master_dtype of that run" in changed
    fresh = _refusal(paths, params, subgroup_size="8KiB")
    assert "its subgroup_size is 16384" in fresh and f"give an empty directory, or delete {paths[0]}" in fresh


def test_a_run_file_without_a_plan_falls_back_to_the_layout_hashes(paths):
    params = make_params()
    run_offload(optax.adam(1e-2), params, 1, [paths[0]], subgroup_size=SUBGROUP)
    (run_file,) = Path(paths[0]).glob("*/run.json")
    identity = json.loads(run_file.read_text())
    run_file.write_text(json.dumps({k: v for k, v in identity.items() if k != "plan"}))  # as version 0.1 wrote it
    message = _refusal(paths, params, subgroup_size="8KiB", resume=True)
    assert f"layout hash {identity['layout_hash']}, expected " in message
    tx = jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP, resume=True)
    assert int(tx.init(params).step) == 1
    tx.close()


def test_integer_params_are_refused_at_init_before_anything_is_written(paths):
    params = dict(make_params(), steps=jnp.zeros((3,), jnp.int32))
    tx = jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP)
    with pytest.raises(jax_mlp.OffloadError, match=r"param leaf \['steps'\] has dtype int32") as refused:
        tx.init(params)
    assert "nnx.state(model, nnx.Param)" in str(refused.value)
    assert not list(Path(paths[0]).rglob("run.json")) and not list(Path(paths[0]).rglob("zarr.json"))


def test_a_host_cache_larger_than_the_memory_is_refused_when_the_offload_is_made(paths):
    memory = total_memory()
    with pytest.raises(jax_mlp.OffloadError, match=r"host_cache=.* is larger than this machine's memory") as refused:
        jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], host_cache=2 * memory)
    assert jax_mlp.format_bytes(memory) in str(refused.value)
    assert not list(Path(paths[0]).rglob("run.json"))


def test_a_corrupt_record_is_caught_by_its_checksum(paths):
    params = make_params()
    # No read-ahead after init: it could read the record before the test corrupts it (with the default
    # depth of 4 it reaches subgroup 3).
    tx = jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP, idle_prefetch=False)
    state = tx.init(params)
    chunk = paths[0] / "proc0000" / "sg000003.0" / "c" / "0"
    data = bytearray(chunk.read_bytes())
    data[HEADER_SIZE + 5] ^= 0x40
    chunk.write_bytes(bytes(data))
    with pytest.raises(jax_mlp.RecordError, match=r"sg000003\.0 fails its checksum"):
        tx.update(grads_at(params, 0), state, params)
    tx.close()


def test_records_sealed_by_zlib_as_before_resume_and_train_on(paths, monkeypatch):
    """The default install used to seal records with zlib's CRC-32; ISA-L's is the same checksum."""
    params = make_params()
    options = dict(subgroup_size=SUBGROUP, host_cache=0)
    expected = run_offload(optax.adam(1e-2), params, 4, [paths[1]], **options)[0]

    with monkeypatch.context() as old_code:
        old_code.setattr(record, "crc32", zlib.crc32)
        tx = jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], **options)
        state = tx.init(params)
        current = params
        for step in range(2):
            updates, state = tx.update(grads_at(current, step), state, current)
            current = optax.apply_updates(current, updates)
        tx.close()
    assert record.crc32 is not zlib.crc32
    tx = jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], resume=True, **options)
    state = tx.init(params)  # verifies every record of the last step
    assert int(state.step) == 2
    for step in range(2, 4):
        updates, state = tx.update(grads_at(current, step), state, current)
        current = optax.apply_updates(current, updates)
    tx.close()
    assert_same_bits(current, expected)


def test_a_failed_write_loses_nothing_and_the_update_can_be_retried(paths, monkeypatch):
    params = make_params()
    options = dict(subgroup_size=SUBGROUP, host_cache="20KiB")
    expected = run_offload(optax.adam(1e-2), params, 3, [paths[1]], **options)[0]

    tx = jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], **options)
    state = tx.init(params)
    current = params
    updates, state = tx.update(grads_at(current, 0), state, current)
    current = optax.apply_updates(current, updates)

    original_write = PathStore.write

    def failing_write(self, subgroup, slot, record):
        if subgroup == 4:
            raise jax_mlp.PathError(f"path {self.root} is full (no space left on device)")
        return original_write(self, subgroup, slot, record)

    monkeypatch.setattr(PathStore, "write", failing_write)
    with pytest.raises(jax_mlp.PathError, match="is full"):
        tx.update(grads_at(current, 1), state, current)
    monkeypatch.setattr(PathStore, "write", original_write)
    for step in (1, 2):
        updates, state = tx.update(grads_at(current, step), state, current)
        current = optax.apply_updates(current, updates)
    tx.close()
    assert_same_bits(current, expected)


def test_stats_are_easy_to_log(paths):
    params = dict(make_params(), odd=jnp.ones((7, 13)))  # a shape no other test compiles
    logged = []
    tx = jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP, on_stats=logged.append)
    state = tx.init(params)
    _, state = tx.update(grads_at(params, 0), state, params)
    assert [s.step for s in logged] == [0, 1]
    row = logged[-1].as_dict()
    assert row["step"] == 1 and row[f"bytes_read[{paths[0]}]"] > 0
    assert all(isinstance(v, (int, float)) for v in row.values())
    assert logged[0].compiles >= 1 and logged[-1].total_compiles >= logged[-1].compiles
    tx.close()


def test_chunks_of_one_leaf_share_a_compilation(paths):
    params = {"big": jnp.ones((1024, 64), jnp.float32)}
    tx = jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size="16KiB")
    state = tx.init(params)
    _, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    assert len(tx.offloader.plan.subgroups) >= 16
    assert tx.stats.compiles <= 2  # full-size chunks and the last one
    tx.close()


def test_context_manager_flushes_and_delete_removes_files(paths):
    params = make_params()
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP, host_cache="1MiB") as tx:
        state = tx.init(params)
        tx.update(grads_at(params, 0), state, params)
    resumed = jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP, resume=True)
    assert int(resumed.init(params).step) == 1
    resumed.close(delete=True)
    assert not paths[0].exists()


def test_update_without_params_matches_optax_and_needs_them_only_when_optax_does(paths):
    params = make_params()
    tx = jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP)
    state = tx.init(params)
    updates, state = tx.update(grads_at(params, 0), state)
    expected, _ = optax.adam(1e-2).update(grads_at(params, 0), optax.adam(1e-2).init(params))
    assert_close_to_optax(updates, expected, bound=1e-6)
    tx.close()

    tx = jax_mlp.mlp_offload(optax.adamw(1e-2), paths=[paths[1]], subgroup_size=SUBGROUP)
    state = tx.init(params)
    with pytest.raises(ValueError, match="params"):  # optax's own error: adamw needs params
        tx.update(grads_at(params, 0), state)
    tx.close()


def test_a_failed_resume_leaves_the_directory_usable(paths):
    params = make_params()
    with pytest.raises(jax_mlp.OffloadError, match=r"no path .* holds offloaded optimizer state"):
        jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], resume=True).init(params)
    tx = jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]])
    assert int(tx.init(params).step) == 0
    tx.close()


def test_a_failing_stats_callback_does_not_lose_the_step(paths, caplog):
    def broken(stats):
        raise RuntimeError("logger is down")

    params = make_params()
    tx = jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP, on_stats=broken)
    state = tx.init(params)
    for step in range(2):
        _, state = tx.update(grads_at(params, step), state, params)
    assert int(state.step) == 2
    assert "on_stats callback" in caplog.text
    tx.close()


def test_updates_keep_the_params_commitment_so_steady_steps_compile_nothing(paths):
    params = dict(make_params(), odd=jnp.ones((5, 11)))  # a shape no other test compiles
    assert not jax.tree.leaves(params)[0].committed
    tx = jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP, host_cache="64KiB")
    state = tx.init(params)
    for step in range(3):
        updates, state = tx.update(grads_at(params, step), state, params)
        assert not any(u.committed for u in jax.tree.leaves(updates))
        params = optax.apply_updates(params, updates)
        if step > 0:
            assert tx.stats.compiles == 0, step
    assert tx.stats.total_compiles >= 1
    tx.close()


def test_a_path_can_be_any_tensorstore_kvstore(paths):
    """A kvstore spec (here tensorstore's in-memory store) works like a directory, bit for bit."""
    params = make_params()
    memory = {"driver": "memory", "path": "run1"}
    got, stats = run_offload(optax.adam(1e-2), params, 3, [memory, paths[0]], subgroup_size=SUBGROUP)
    assert stats.bytes_read["memory://run1/"] > 0
    expected = run_offload(optax.adam(1e-2), params, 3, [paths[1]], subgroup_size=SUBGROUP)[0]
    assert_same_bits(got, expected)
    with pytest.raises(jax_mlp.OffloadError, match="needs a 'driver'"):
        jax_mlp.mlp_offload(optax.adam(1e-2), paths=[{"path": "x"}])


def test_identical_blocks_share_one_compilation(paths):
    """24 identical blocks, 3 per subgroup: every subgroup lowers to one program, compiled once."""
    block = {"w": jnp.ones((24, 40)), "b": jnp.zeros((40,)), "scale": jnp.ones((40,))}
    params = {f"block{i:02d}": jax.tree.map(lambda x, i=i: x * (1 + i), block) for i in range(24)}
    inner = optax.adamw(1e-3, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    tx = jax_mlp.mlp_offload(inner, paths=[paths[0]], subgroup_size=3 * (24 * 40 + 80) * 8)
    state = tx.init(params)
    init_compiles = tx.stats.compiles
    _, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    assert len(tx.offloader.plan.subgroups) == 8
    assert init_compiles <= 2 and tx.stats.compiles <= 2, (init_compiles, tx.stats.compiles)
    tx.close()


def test_a_master_of_the_params_own_dtype_is_refused_and_a_mixed_tree_keeps_one(paths):
    params = make_params()
    tx = jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], master_dtype=jnp.float32)
    with pytest.raises(jax_mlp.OffloadError, match=r"every param leaf is already float32.*Leave master_dtype unset"):
        tx.init(params)
    assert not list(Path(paths[0]).rglob("run.json"))
    mixed = dict(params, embed=params["embed"].astype(jnp.bfloat16))
    tx = jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[1]], subgroup_size=SUBGROUP, master_dtype=jnp.float32)
    tx.init(mixed)
    assert all(sg.layout.master_fields for sg in tx.offloader.plan.subgroups)
    tx.close()
