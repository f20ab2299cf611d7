"""Faults give an error that names the path or record and the remedy, and the previous step stays restorable.

A full disk and a read-only remount use a real tmpfs (root only); injected variants of the same OS
errors always run.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import subprocess

import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest
from faults import inject_write_faults
from helpers import STORE_OPTIONS, abstract, assert_close_to_optax, assert_same_bits, make_params, tmpfs, train

import jax_mlp
from jax_mlp._src.storage import capacity
from jax_mlp._src.storage.paths import open_path
from jax_mlp._src.storage.record import HEADER_SIZE, verify

# A fixed placement, so each fault hits the path it is made on: a rebalancing move could take every
# record off it, or delete records there and free the space a full disk test has taken.
OPTIONS = {
    "subgroup_size": "16KiB",
    "host_cache": "40KiB",
    "master_dtype": jnp.float32,
    "master_storage": "full",  # restore_params reads the params back from the tiers
    "placement": "round_robin",
    "rebalance": False,
}


# One optimizer object for the module: compiled subgroup updates are cached per object.
INNER = optax.adam(1e-2)


def start(paths, **options):
    tx = jax_mlp.mlp_offload(INNER, paths=paths, **{**OPTIONS, **options})
    params = make_params(dtype=jnp.bfloat16)
    return tx, params, tx.init(params)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Params after each of 8 uninterrupted steps."""
    tx, params, state = start([tmp_path_factory.mktemp("reference")])
    with tx:
        history = [params]
        for step in range(8):
            params, state = train(tx, params, state, [step])
            history.append(params)
    return history


def resume_and_finish(paths, steps_done, reference):
    """Resumes from the tiers alone, checks the params, trains to step 8; returns the params."""
    with jax_mlp.mlp_offload(INNER, paths=paths, resume=True, **OPTIONS) as tx:
        state = tx.init(abstract(reference[0]))
        assert int(state.step) == steps_done
        params = jax_mlp.restore_params(tx, abstract(reference[0]))
        assert_same_bits(params, reference[steps_done])
        params, _ = train(tx, params, state, range(steps_done, 8))
    return params


def fill(directory):
    """Takes all the free space left on ``directory``'s file system, as another program would."""
    with open(directory / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while f.write(b"\0" * 4096):
            pass
    assert shutil.disk_usage(directory).free < 4096


def test_a_full_disk_names_the_path_and_the_last_step_resumes_on_a_roomy_path(tmp_path, reference):
    with tmpfs(tmp_path / "nvme", "4m") as nvme:
        tx, params, state = start([nvme, tmp_path / "pfs"])
        with tx:
            params, state = train(tx, params, state, range(3))
            assert any(nvme.glob("proc0000/sg*")), "the small path holds records"
            # The last update's idle-time write-back must land before the disk fills: if it met the full disk
            # instead, its records would stay dirty in the cache and close() would fail to flush them too.
            tx.flush()
            print(f"records take {shutil.disk_usage(nvme).used / 2**20:.2f} MiB of the tmpfs before it is filled")
            fill(nvme)
            with pytest.raises(jax_mlp.PathError, match=rf"path {nvme} is full.*free space there or give another path"):
                train(tx, params, state, [3])
            # The remedy "give another path": move the full path's records to a roomy one and resume there.
            shutil.copytree(nvme, tmp_path / "roomy", ignore=shutil.ignore_patterns("filler"))
    finished = resume_and_finish([tmp_path / "roomy", tmp_path / "pfs"], 3, reference)
    assert_same_bits(finished, reference[8])


def test_a_path_remounted_read_only_names_the_path_and_the_update_can_be_retried(tmp_path, reference):
    with tmpfs(tmp_path / "nvme", "8m") as nvme:
        tx, params, state = start([nvme, tmp_path / "pfs"])
        with tx:
            params, state = train(tx, params, state, range(2))
            subprocess.run(["mount", "-o", "remount,ro", str(nvme)], check=True)
            with pytest.raises(jax_mlp.PathError, match=rf"path {nvme} is not writable \(a read-only file system\)"):
                train(tx, params, state, [2])
            subprocess.run(["mount", "-o", "remount,rw", str(nvme)], check=True)
            params, _ = train(tx, params, state, range(2, 8))  # the same opt_state: nothing was lost
    assert_same_bits(params, reference[8])


TENSORSTORE_ENOSPC = ValueError(
    'RESOURCE_EXHAUSTED: Error writing local file "c/0": Failed to write 8320 bytes to file 3: No space left on '
    "device [os_error_code='28']"
)
TENSORSTORE_EROFS = ValueError(
    "PERMISSION_DENIED: Error writing local file \"zarr.json\": Read-only file system [os_error_code='30']"
)


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "is full.*free space there or give another path"),
        (TENSORSTORE_ENOSPC, "is full.*free space there or give another path"),
        (OSError(errno.EROFS, os.strerror(errno.EROFS)), r"is not writable \(a read-only file system\); remount"),
        (TENSORSTORE_EROFS, r"is not writable \(a read-only file system\); remount"),
        (OSError(errno.EACCES, os.strerror(errno.EACCES)), "is not writable; fix its permissions or give another"),
    ],
    ids=["enospc", "tensorstore-enospc", "erofs", "tensorstore-erofs", "eacces"],
)
def test_injected_os_errors_name_the_path_and_remedy_and_lose_nothing(paths, reference, monkeypatch, error, message):
    fault = inject_write_faults(monkeypatch)
    tx, params, state = start(paths[:2])
    with tx:
        params, state = train(tx, params, state, range(2))
        tx.flush()  # the idle-time write-back of step 2 is done: the fault hits update 2's own writes
        broken = str(paths[1])
        fault.fail(error, root=broken)
        with pytest.raises(
            jax_mlp.PathError, match=rf"writing record {broken}/proc0000/sg\d+\.1: path {broken} {message}"
        ):
            train(tx, params, state, [2])
        fault.clear()  # space freed, permissions fixed
        params, _ = train(tx, params, state, range(2, 8))
    assert_same_bits(params, reference[8])


def test_a_path_that_vanishes_mid_run_is_named_and_the_last_checkpoint_restores(paths, reference, tmp_path):
    tx, params, state = start(paths[:2])
    with tx:
        with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
            params, state = train(tx, params, state, range(2))
            manager.save(
                2, args=ocp.args.Composite(params=ocp.args.StandardSave(params), opt_state=jax_mlp.OffloadSave(tx))
            )
            params, state = train(tx, params, state, [2, 3])
        shutil.rmtree(paths[1])
        with pytest.raises(jax_mlp.PathError, match=rf"path {paths[1]} is gone.*restore it or give another path"):
            train(tx, params, state, [4])
        tx.close(delete=True)
    assert_same_bits(restore_and_finish(tmp_path, paths[2], reference), reference[8])


def record_dir(path, subgroup, slot):
    return path / "proc0000" / f"sg{subgroup:06d}.{slot}"


def checkpoint_then_damage(paths, tmp_path, damage):
    """Trains 3 steps with a checkpoint at step 2, damages a record of step 3, then runs update 3.

    Returns the raised error and what ``resume`` then says; checks that the checkpoint restores.
    """
    tx, params, state = start([paths[0]], host_cache=0)
    with tx:
        with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
            params, state = train(tx, params, state, range(2))
            manager.save(
                2, args=ocp.args.Composite(params=ocp.args.StandardSave(params), opt_state=jax_mlp.OffloadSave(tx))
            )
            params, state = train(tx, params, state, [2])
        damage()
        with pytest.raises(jax_mlp.RecordError) as raised:
            train(tx, params, state, [3])
    # Update 3 had already overwritten step 2 of other subgroups: no step is complete in the tiers.
    with (
        pytest.raises(jax_mlp.RecordError, match=r"no step has a complete.*restore from a checkpoint"),
        jax_mlp.mlp_offload(INNER, paths=[paths[0]], resume=True, **OPTIONS) as resumed,
    ):
        resumed.init(abstract(params))
    return raised.value


def restore_and_finish(tmp_path, directory, reference):
    with jax_mlp.mlp_offload(INNER, paths=[directory], **OPTIONS) as fresh:
        like = abstract(reference[0])
        with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
            args = ocp.args.Composite(
                params=ocp.args.StandardRestore(like), opt_state=jax_mlp.OffloadRestore(fresh, like)
            )
            restored = manager.restore(2, args=args)
        params, _ = train(fresh, restored["params"], restored["opt_state"], range(2, 8))
    return params


def test_a_truncated_record_is_named_and_the_last_checkpoint_restores(paths, reference, tmp_path):
    chunk = record_dir(paths[0], 2, 3 % 2) / "c" / "0"

    def cut_short():  # as a copy cut off, or a file system that lost the file's tail
        chunk.write_bytes(chunk.read_bytes()[:100])

    error = checkpoint_then_damage(paths, tmp_path, cut_short)
    assert re.search(r"record \S+/sg000002\.1 is missing or unreadable.*restore the last checkpoint", str(error))
    assert_same_bits(restore_and_finish(tmp_path, paths[1], reference), reference[8])


def test_a_record_of_another_run_is_caught_by_the_layout_hash(paths, reference, tmp_path):
    with jax_mlp.mlp_offload(optax.adamw(1e-2), paths=[paths[2]], **{**OPTIONS, "host_cache": 0}) as other:
        other.init(make_params(dtype=jnp.bfloat16))  # records of the same sizes, of another optimizer
    own = record_dir(paths[0], 1, 3 % 2)

    def replace():
        shutil.rmtree(own)
        shutil.copytree(record_dir(paths[2], 1, 0), own)

    error = checkpoint_then_damage(paths, tmp_path, replace)
    assert re.search(rf"record {own} belongs to another run or subgroup layout \(layout hash [0-9a-f]+", str(error))
    assert_same_bits(restore_and_finish(tmp_path, paths[1], reference), reference[8])


def test_damage_found_on_resume_falls_back_to_the_previous_step(paths, reference):
    """Closed tiers hold two complete steps; a record of the newer one shorter than its header says is skipped."""
    tx, params, state = start([paths[0]], host_cache=0)
    with tx:
        train(tx, params, state, range(3))
        layout_hash = tx.plan.layout_hash
    store = open_path(jax_mlp.Path(paths[0]), **STORE_OPTIONS)
    record = store.read(2, 3 % 2)
    shutil.rmtree(record_dir(paths[0], 2, 3 % 2))
    store.write(2, 3 % 2, record[: HEADER_SIZE + (record.nbytes - HEADER_SIZE) // 2])
    with pytest.raises(jax_mlp.RecordError, match=r"record sg2 is truncated: \d+ of \d+ bytes"):
        verify(store.read(2, 3 % 2), name="sg2", step=3, layout_hash=layout_hash)
    assert_same_bits(resume_and_finish([paths[0]], 2, reference), reference[8])


def files_under(directory):
    """Every file below ``directory`` with its size, by relative name."""
    return {str(f.relative_to(directory)): f.stat().st_size for f in directory.rglob("*") if f.is_file()}


def test_a_path_without_room_for_two_slots_of_its_share_is_refused_at_init_with_nothing_written(tmp_path):
    """One slot of the state fits on the tmpfs, two do not: without the check, the first update would
    fill it mid-run. The error comes at init instead, and a second path taking half the share is the remedy."""
    params = {"w": jnp.ones((256, 256), jnp.float32)}  # 512 KiB of adam state in 8 records of 64 KiB
    with tmpfs(tmp_path / "nvme", "1m") as nvme:
        with (
            jax_mlp.mlp_offload(INNER, paths=[nvme], subgroup_size="64KiB") as tx,
            pytest.raises(jax_mlp.PathError) as refused,
        ):
            tx.init(params)
        # 8 slots of 64 KiB + 64 B records: 68 KiB of chunk files and 3 blocks of metadata each, twice, + 5%.
        need = 2 * 8 * (69632 + 3 * 4096) * 1.05
        message = re.fullmatch(
            rf"path {nvme} has ([\d.]+) KiB free, but its share of 8 records needs {need / 2**20:.1f} MiB: two "
            r"slots of each record plus 5% headroom; free space there, give another path .*, or give this path a "
            r"smaller share: declare a lower read_bandwidth and write_bandwidth for it with jax_mlp\.Path",
            str(refused.value),
        )
        assert message, str(refused.value)
        assert float(message.group(1)) == 1020  # 1 MiB less the holder file of this writer
        assert 8 * 69632 < shutil.disk_usage(nvme).total < need, "one slot fits, two do not"
        assert files_under(nvme) == {"proc0000/writer.lock": 0}, "no record, no run.json, no holder: the lock let go"
        assert shutil.disk_usage(nvme).used == 0
        # Given a second path, this one's share halves and fits: the same path is free to take.
        with jax_mlp.mlp_offload(
            INNER, paths=[nvme, tmp_path / "pfs"], subgroup_size="64KiB", placement="round_robin"
        ) as shared:
            _, state = train(shared, params, shared.init(params), range(2))
            assert int(state.step) == 2


def disk_bytes(directory):
    """What ``directory`` takes on its file system, files and directories alike, as ``du`` counts it."""
    return sum(entry.lstat().st_blocks * 512 for entry in [directory, *directory.rglob("*")])


def test_the_needed_room_bounds_what_a_path_then_holds(tmp_path):
    """The figure is close to the truth: once updates have filled both slots, the path's run directory
    takes at most what the check asked for, and no less than that without its headroom."""
    tx, params, state = start([tmp_path / "nvme"], host_cache=0)
    with tx:
        record_bytes = [HEADER_SIZE + subgroup.layout.nbytes for subgroup in tx.plan.subgroups]
        train(tx, params, state, range(2))
        tx.flush()
        used, need = disk_bytes(tmp_path / "nvme" / "proc0000"), capacity.need(record_bytes)
        print(f"{len(record_bytes)} records: {used} bytes on disk, {need} asked for by the check")
        assert need / (1 + capacity.HEADROOM) * 0.95 <= used <= need


def test_paths_on_one_file_system_share_its_free_space(tmp_path):
    """Each half of the share fits on the tmpfs, but not both: the error names both paths."""
    params = {"w": jnp.ones((256, 256), jnp.float32)}
    with (
        tmpfs(tmp_path / "nvme", "1m") as nvme,
        jax_mlp.mlp_offload(
            INNER, paths=[nvme / "a", nvme / "b"], subgroup_size="64KiB", placement="round_robin"
        ) as tx,
        pytest.raises(
            jax_mlp.PathError,
            match=rf"paths {nvme}/a: 672\.0 KiB for 4 records, {nvme}/b: 672\.0 KiB for 4 records share one file "
            r"system, which has 1016\.0 KiB free, but they need 1\.3 MiB: two slots .* or give one of them a smaller share",
        ),
    ):
        tx.init(params)


def test_an_init_refused_for_room_can_be_retried_with_another_tree(tmp_path):
    """A failed init keeps nothing of its plan: retried with other params, the offload trains those exactly."""
    inner = optax.adam(1e-2)
    with tmpfs(tmp_path / "nvme", "1m") as nvme, jax_mlp.mlp_offload(inner, paths=[nvme], subgroup_size="64KiB") as tx:
        too_big = {"w": jnp.ones((512, 256), jnp.float32)}  # 1 MiB of adam state: more than the tmpfs holds
        with pytest.raises(
            jax_mlp.PathError, match=rf"path {nvme} has 1020\.0 KiB free, but its share of 16 records needs 2\.6 MiB"
        ):
            tx.init(too_big)
        params = make_params()
        params, _ = train(tx, params, tx.init(params), range(3))
    expected, _ = train(inner, make_params(), inner.init(make_params()), range(3))
    assert_close_to_optax(params, expected)
