"""kill -9 during an update loses nothing: the tiers resume at the last complete step, bit for bit.

A child process trains with bf16 params and fp32 master params in the tiers and SIGKILLs itself at a
chosen point: inside update 6 while reading, mid-compute, or with writes in flight (one record half
written), or between updates while the cached records of step 6 are written back. The test then
resumes from the tiers alone, takes the params from the master copy, restarts the data at the
resumed step and compares with an uninterrupted run.
"""

from __future__ import annotations

import json
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
from helpers import STORE_OPTIONS, assert_same_bits, make_params, train

import jax_mlp
from jax_mlp._src.storage.paths import open_path

TESTS = Path(__file__).resolve().parent
# Full masters: the tiers alone give the params back (restore_params), with no checkpoint.
OPTIONS = {"subgroup_size": "32KiB", "host_cache": "80KiB", "master_dtype": jnp.float32, "master_storage": "full"}
KILLED_AT = 6
STEPS = 10
# Where each child dies, and the step the tiers must resume at: killed inside update 6, step 6 is
# complete on storage; killed while step 6's cached records are written back after update 5, it
# is not, and step 5 is the last complete one.
RESUMES_AT = {"read": KILLED_AT, "compute": KILLED_AT, "write": KILLED_AT, "writeback": KILLED_AT - 1}


# One optimizer object for the module: compiled subgroup updates are cached per object.
INNER = optax.adamw(1e-2, weight_decay=0.1)


CHILD = textwrap.dedent(
    """
    import json, os, signal, sys
    sys.path.insert(0, sys.argv[1])
    import jax_mlp
    from jax_mlp._src.offload.offloader import Offloader
    from jax_mlp._src.stream.engine import Engine
    from jax_mlp._src.storage.paths import PathStore
    from jax_mlp._src.storage.tier_stack import TierStack
    from helpers import make_params, train
    from test_crash import KILLED_AT, OPTIONS, STEPS, INNER

    root, point = sys.argv[2], sys.argv[3]
    calls, updating = [], []
    fetch, run, write, update = TierStack.fetch, Engine.pipeline, PathStore.write, Offloader.update

    def die(**where):
        with open(f"{root}/killed.json", "w") as f:
            json.dump({"point": point, "subgroups": subgroups, **where}, f)
        os.kill(os.getpid(), signal.SIGKILL)

    def in_update(self, *args, **kwargs):
        updating.append(self.live.stream.step)
        try:
            return update(self, *args, **kwargs)
        finally:
            updating.pop()

    def reading(self, subgroup, step, **options):
        if updating == [KILLED_AT]:
            calls.append(subgroup)
            if len(calls) == 2:
                die(subgroup=subgroup)
        return fetch(self, subgroup, step, **options)

    def running(self, order, fetch, compute, store, *describe, **stage):
        def computing(index, fetched):
            if updating == [KILLED_AT]:
                calls.append(index)
                if len(calls) == subgroups // 2:
                    die(computed=len(calls) - 1)
            return compute(index, fetched)

        return run(self, order, fetch, computing, store, *describe, **stage)

    def writing(self, subgroup, slot, record):
        # "write": a record of step KILLED_AT + 1 inside update KILLED_AT; "writeback": a dirty cached
        # record of step KILLED_AT written back in the idle time after the update that made it.
        during = updating == [KILLED_AT] and slot == (KILLED_AT + 1) % 2
        idle = tx.step == KILLED_AT and slot == KILLED_AT % 2  # update 5 is done computing
        if (point == "write" and during) or (point == "writeback" and idle):
            calls.append(subgroup)
            if len(calls) == (subgroups // 2 if point == "write" else 1):
                torn = record.copy()
                torn[record.nbytes // 2 :] = 0  # half of the record reached the disk
                write(self, subgroup, slot, torn)
                die(subgroup=subgroup, path=self.root, slot=slot, written=len(calls) - 1)
        return write(self, subgroup, slot, record)

    Offloader.update = in_update
    TierStack.fetch, Engine.pipeline, PathStore.write = {
        "read": (reading, run, write),
        "compute": (fetch, running, write),
        "write": (fetch, run, writing),
        "writeback": (fetch, run, writing),
    }[point]
    tx = jax_mlp.mlp_offload(INNER, paths=[f"{root}/nvme", f"{root}/pfs"], **OPTIONS)
    state = tx.init(make_params(dtype="bfloat16"))
    subgroups = len(tx.plan.subgroups)
    train(tx, make_params(dtype="bfloat16"), state, range(STEPS))
    print("the kill point was never reached")
    """
)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    with jax_mlp.mlp_offload(INNER, paths=[root / "nvme", root / "pfs"], **OPTIONS) as tx:
        params = make_params(dtype=jnp.bfloat16)
        params, _ = train(tx, params, tx.init(params), range(STEPS))
    return params


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Runs the three children at once; returns each one's directory."""
    roots = {point: tmp_path_factory.mktemp(f"killed_{point}") for point in RESUMES_AT}
    children = {
        point: subprocess.Popen(
            [sys.executable, "-c", CHILD, str(TESTS), str(root), point],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for point, root in roots.items()
    }
    for point, child in children.items():
        out, err = child.communicate(timeout=600)
        assert child.returncode == -signal.SIGKILL, f"{point}: rc={child.returncode}\n{out}\n{err[-3000:]}"
    return roots


@pytest.mark.parametrize("point", list(RESUMES_AT))
def test_kill_9_during_an_update_resumes_from_the_tiers_bitwise(point, killed, uninterrupted):
    root = killed[point]
    where = json.loads((root / "killed.json").read_text())
    assert where["point"] == point
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), make_params(dtype=jnp.bfloat16))
    with jax_mlp.mlp_offload(INNER, paths=[root / "nvme", root / "pfs"], resume=True, **OPTIONS) as tx:
        state = tx.init(like)
        step = int(state.step)
        assert step == RESUMES_AT[point], f"killed at {where}, resumed at step {step}"
        if "path" in where:  # the half-written record is there, and its checksum rejects it
            torn = open_path(jax_mlp.Path(where["path"]), **STORE_OPTIONS)
            assert (Path(torn.directory) / f"sg{where['subgroup']:06d}.{where['slot']}" / "zarr.json").exists()
            assert torn.verified_step(where["subgroup"], where["slot"], tx.plan.layout_hash) is None
        params = jax_mlp.restore_params(tx, like)
        params, _ = train(tx, params, state, range(step, STEPS))  # the data restarts at the resumed step
    assert_same_bits(params, uninterrupted, f"killed at {where}")


def test_restore_params_needs_master_params_in_the_tiers(tmp_path):
    params = make_params()
    with jax_mlp.mlp_offload(INNER, paths=[tmp_path / "a"], subgroup_size="16KiB") as tx:
        with pytest.raises(jax_mlp.OffloadError, match="needs an initialised"):
            jax_mlp.restore_params(tx, params)
        tx.init(params)
        with pytest.raises(jax_mlp.OffloadError, match=r"master_dtype=None.*restore them from a checkpoint"):
            jax_mlp.restore_params(tx, params)


def test_restore_params_checks_the_tree_it_is_given(tmp_path):
    params = make_params(dtype=jnp.bfloat16)
    with jax_mlp.mlp_offload(INNER, paths=[tmp_path / "a"], **OPTIONS) as tx:
        tx.init(params)
        with pytest.raises(jax_mlp.OffloadError, match=r"\['embed'\] is float32\[40, 16\].*bfloat16\[40, 16\]"):
            jax_mlp.restore_params(tx, dict(params, embed=params["embed"].astype(jnp.float32)))
        assert_same_bits(jax_mlp.restore_params(tx, params), params)


# The "Restart after a crash" recipe of docs/checkpoints.md, as a script run twice on the same paths.
RECIPE_STEPS, SAVE_EVERY, RECIPE_KILLED_AT = 8, 3, 4
RECIPE = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    import jax, numpy as np, optax, orbax.checkpoint as ocp
    import jax_mlp
    from helpers import grads_at, make_params
    from test_crash import RECIPE_STEPS, SAVE_EVERY

    root = sys.argv[2]
    offload = jax_mlp.mlp_offload(optax.adam(1e-2), paths=[f"{root}/nvme", f"{root}/pfs"], subgroup_size="32KiB")
    manager = ocp.CheckpointManager(f"{root}/ckpt")
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), make_params())
    start = manager.latest_step()  # the last checkpoint's step, None before the first
    if start is None:
        start, params = 0, make_params()
        state = offload.init(params)
    else:  # restored onto the same paths: the state the tiers hold after the crash is replaced
        args = {"params": ocp.args.StandardRestore(like), "opt_state": jax_mlp.OffloadRestore(offload, like)}
        restored = manager.restore(start, args=ocp.args.Composite(**args))
        params, state = restored["params"], restored["opt_state"]
    for step in range(start, RECIPE_STEPS):
        updates, state = offload.update(grads_at(params, step), state, params)
        params = optax.apply_updates(params, updates)
        if (step + 1) % SAVE_EVERY == 0:
            saved = ocp.args.Composite(params=ocp.args.StandardSave(params), opt_state=jax_mlp.OffloadSave(offload))
            manager.save(step + 1, args=saved)
    manager.wait_until_finished()
    offload.close()
    np.savez(f"{root}/params.npz", *jax.tree.leaves(params))
    """
)
KILL_IN_RECIPE = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, sys.argv[1])
    import orbax.checkpoint as ocp
    import jax_mlp
    from jax_mlp._src.offload.offloader import Offloader
    from jax_mlp._src.storage.paths import PathStore
    from test_crash import RECIPE, RECIPE_KILLED_AT

    save, write, init = ocp.CheckpointManager.save, PathStore.write, Offloader.init
    writes, subgroups = [], None

    def saved(self, *args, **kwargs):  # the checkpoint is whole before the kill
        done = save(self, *args, **kwargs)
        self.wait_until_finished()
        return done

    def writing(self, subgroup, slot, record):
        if subgroups is not None:  # counts the updates' writes; without a host cache, one per subgroup
            writes.append(subgroup)
        if subgroups is not None and len(writes) == subgroups * RECIPE_KILLED_AT + subgroups // 2:
            write(self, subgroup, slot, record)
            os.kill(os.getpid(), signal.SIGKILL)  # inside update RECIPE_KILLED_AT, half its records written
        return write(self, subgroup, slot, record)

    def initialised(self, params):
        global subgroups
        state = init(self, params)
        subgroups = len(self.live.plan.subgroups)
        return state

    ocp.CheckpointManager.save, PathStore.write, Offloader.init = saved, writing, initialised
    exec(RECIPE)
    """
)


def _recipe(script: str, root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script, str(TESTS), str(root)], capture_output=True, text=True, timeout=600
    )


def test_restarting_after_a_kill_9_restores_the_checkpoint_onto_the_same_paths_bitwise(tmp_path):
    killed = _recipe(KILL_IN_RECIPE, tmp_path / "restarted")
    assert killed.returncode == -signal.SIGKILL, f"rc={killed.returncode}\n{killed.stderr[-3000:]}"
    paths = [tmp_path / "restarted" / "nvme", tmp_path / "restarted" / "pfs"]
    with (
        jax_mlp.mlp_offload(optax.adam(1e-2), paths=paths, subgroup_size="32KiB") as held,
        pytest.raises(jax_mlp.OffloadError, match=r"already holds this run's .*step 5.*OffloadRestore"),
    ):
        held.init(make_params())  # the tiers went on past the checkpoint of step 3
    restarted = _recipe(RECIPE, tmp_path / "restarted")  # the same script, run again
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "hold this run's offloaded state up to step 5: that state is discarded" in restarted.stderr
    uninterrupted = _recipe(RECIPE, tmp_path / "uninterrupted")
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    assert "discarded" not in uninterrupted.stderr
    with np.load(tmp_path / "restarted" / "params.npz") as a, np.load(tmp_path / "uninterrupted" / "params.npz") as b:
        assert_same_bits([a[k] for k in sorted(a)], [b[k] for k in sorted(b)])
