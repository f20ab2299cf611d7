"""``storage/ownership.py``: one live writer per run, a path's run directory is held from init to close, and kill -9
leaves no stale lock.

The second writer is a second ``mlp_offload`` in this process, or this process against a real child
process that holds the paths (with the node lock on); the child is then killed with SIGKILL.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import STORE_OPTIONS, abstract, as_bits, make_params, train

import jax_mlp
from jax_mlp._src.storage import ownership
from jax_mlp._src.storage.paths import open_path

TESTS = Path(__file__).resolve().parent
OPTIONS = {"subgroup_size": "16KiB", "master_dtype": jnp.float32, "master_storage": "full"}  # for restore_params
HELD_STEPS = 3

# One optimizer object for the module: compiled subgroup updates are cached per object.
INNER = optax.adam(1e-2)


def offload(paths, **options):
    return jax_mlp.mlp_offload(INNER, paths=paths, **{**OPTIONS, **options})


def test_a_second_writer_in_the_same_process_is_refused_with_and_without_resume(paths):
    params = make_params(dtype=jnp.bfloat16)
    with offload(paths[:2]) as first:
        params, state = train(first, params, first.init(params), range(2))
        for resume in (False, True):
            with (
                offload([paths[2], paths[1]], resume=resume) as second,
                pytest.raises(
                    jax_mlp.PathInUseError,
                    match=rf"path {paths[1]} is in use: its run directory {paths[1]}/proc0000 is held by another mlp_offload "
                    rf"in this process \(pid {os.getpid()} on host {socket.gethostname()}\); close\(\) that one first",
                ),
            ):
                second.init(params)
        # The refusals changed nothing: the first writer goes on, and the path held before the refusal was let go.
        params, state = train(first, params, state, [2])
        with offload([paths[2]]) as third:
            third.init(params)
    with offload(paths[:2], resume=True) as resumed:
        assert int(resumed.init(abstract(params)).step) == 3


def test_a_failed_init_lets_go_of_the_paths(paths):
    params = make_params(dtype=jnp.bfloat16)
    with offload(paths[:1]) as tx:
        tx.init(params)
    with (
        pytest.raises(
            jax_mlp.OffloadError, match=r"already holds this run's offloaded optimizer state.*pass resume=True"
        ),
        offload(paths[:1]) as refused,
    ):
        refused.init(params)  # refused after it took the lock
    with offload(paths[:1], resume=True) as resumed:
        assert int(resumed.init(params).step) == 0
        resumed.close(delete=True)
    assert not paths[0].exists()


def test_processes_sharing_a_path_hold_their_own_run_directories(tmp_path):
    stores = [open_path(jax_mlp.Path(tmp_path), index, **STORE_OPTIONS) for index in (0, 1)]
    for store in stores:
        store.hold()
    with pytest.raises(jax_mlp.PathInUseError, match=rf"run directory {tmp_path}/proc0001 is held"):
        open_path(jax_mlp.Path(tmp_path), 1, **STORE_OPTIONS).hold()
    for store in stores:
        store.release()
    again = open_path(jax_mlp.Path(tmp_path), 1, **STORE_OPTIONS)
    again.hold()
    again.release()


HOLDER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[1])
    import numpy as np
    from helpers import as_bits, make_params, train
    from test_ownership import HELD_STEPS, offload

    root = sys.argv[2]
    tx = offload([f"{root}/nvme", f"{root}/pfs"], node_lock=f"{root}/node_lock")
    params = make_params(dtype="bfloat16")
    params, state = train(tx, params, tx.init(params), range(HELD_STEPS))
    tx.flush()
    np.savez(f"{root}/params.npz", *as_bits(params))
    print("holding", flush=True)
    time.sleep(600)
    """
)


def test_a_writer_in_another_process_is_refused_and_after_kill_9_resume_works(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(TESTS), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = holder.stdout.readline()
        assert line == "holding\n", f"{line}{holder.stderr.read() if holder.poll() is not None else ''}"
        paths = [tmp_path / "nvme", tmp_path / "pfs"]
        like = abstract(make_params(dtype=jnp.bfloat16))
        for resume in (False, True):
            with (
                pytest.raises(
                    jax_mlp.PathInUseError,
                    match=rf"path {paths[0]} is in use: its run directory {paths[0]}/proc0000 is held by another "
                    rf"mlp_offload \(pid {holder.pid} on host {socket.gethostname()}, since [-\d:T+]+\), and two writers "
                    r"would overwrite each other's records; stop that process or wait for it to close, then pass "
                    r"resume=True",
                ),
                offload(paths, node_lock=tmp_path / "node_lock", resume=resume) as refused,
            ):
                refused.init(make_params(dtype=jnp.bfloat16))
        # another process's run directory on the same path
        neighbour = open_path(jax_mlp.Path(paths[0]), 1, **STORE_OPTIONS)
        neighbour.hold()
        neighbour.release()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate(timeout=60)
    assert holder.returncode == -signal.SIGKILL
    # No one removed the lock: the OS let go of it with the dead holder's descriptors.
    assert json.loads((paths[0] / "proc0000" / ownership.HOLDER_FILE).read_text())["pid"] == holder.pid
    with offload(paths, node_lock=tmp_path / "node_lock", resume=True) as tx:
        state = tx.init(like)
        assert int(state.step) == HELD_STEPS
        restored = jax_mlp.restore_params(tx, like)
        held = np.load(tmp_path / "params.npz")
        for index, bits in enumerate(as_bits(restored)):
            np.testing.assert_array_equal(bits, held[f"arr_{index}"])  # the holder's params at its last step
        train(tx, restored, state, [HELD_STEPS])  # and the run goes on


def test_a_file_system_without_locks_is_warned_about_and_keeps_the_in_process_guard(paths, monkeypatch, caplog):
    """Lustre without ``-o flock`` answers flock with ENOSYS; nothing here can mount one, so flock is made to."""

    def no_locks(fd, operation):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(ownership.fcntl, "flock", no_locks)
    params = make_params(dtype=jnp.bfloat16)
    with offload(paths[:1]) as tx:
        with caplog.at_level(logging.WARNING, logger=ownership.__name__):
            tx.init(params)
        assert f"the file system of path {paths[0]} has no file locks" in caplog.text
        with (
            pytest.raises(jax_mlp.PathInUseError, match="held by another mlp_offload in this process"),
            offload(paths[:1], resume=True) as second,
        ):
            second.init(params)
