"""Two real ``jax.distributed`` processes on 127.0.0.1, 4 CPU devices each, sharing a mesh of 8."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from helpers import EXACT_BOUND, assert_close_to_optax, grads_at, make_params, train
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_mlp

TESTS = os.path.dirname(os.path.abspath(__file__))

CHILD = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, sys.argv[5])
    import jax, numpy as np
    # jax.distributed ends a process whose peer died once its heartbeat times out: keep that above
    # peer_timeout, so that mlp_offload's error, which names the cause, comes first.
    jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]), heartbeat_timeout_seconds=30)
    import optax, orbax.checkpoint as ocp, jax_mlp
    from jax.sharding import Mesh, NamedSharding
    from helpers import grads_at, make_params
    from test_multiprocess import spec_of

    # The first 4 devices of each process; in "jit" mode each has a fifth, for the in-jit update.
    mesh = Mesh(np.array([sorted(jax.local_devices(process_index=p), key=lambda d: d.id)[:4] for p in range(2)]),
                ("proc", "local"))
    full = jax.tree.map(np.asarray, make_params())
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec_of(path)), lambda i: x[i]),
        full,
    )
    me, mode = jax.process_index(), sys.argv[4]
    paths = [os.path.join(sys.argv[3], f"nvme{me}"), os.path.join(sys.argv[3], "pfs")]
    if mode == "die":  # slow paths, so that a kill lands in the middle of an update
        paths = [jax_mlp.Path(p, max_read="200KB/s", max_write="200KB/s") for p in paths]
    inner = optax.adamw(1e-2, weight_decay=0.1)
    manager = ocp.CheckpointManager(os.path.join(sys.argv[3], "ckpt"))
    if mode == "restore":  # the checkpoint of step 4, into other paths and another subgroup size
        tx = jax_mlp.mlp_offload(inner, paths=[os.path.join(sys.argv[3], f"new{me}")], subgroup_size="8KiB",
                                 peer_timeout=10)
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
        restored = manager.restore(4, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(like), opt_state=jax_mlp.OffloadRestore(tx, like)))
        params, state = restored["params"], restored["opt_state"]
    else:
        tx = jax_mlp.mlp_offload(inner, paths=paths, subgroup_size="16KiB", peer_timeout=10, resume=mode == "resume")
        state = tx.init(params)
    print(f"init at {int(state.step)}", flush=True)
    written = []  # the regions a save writes, by standard-layout leaf: each element once over both processes
    from jax_mlp._src.checkpoint import save as checkpoint_save
    region_of = checkpoint_save.region_of
    checkpoint_save.region_of = lambda array, region: written.append(region[:2]) or region_of(array, region)
    update = jax.jit(tx.update) if mode == "jit" else tx.update
    for step in range(int(state.step), 10):
        if mode == "save" and step == 4:  # saved in the background while training goes on
            manager.save(4, args=ocp.args.Composite(
                params=ocp.args.StandardSave(params), opt_state=jax_mlp.OffloadSave(tx)))
        print(f"update {step}", flush=True)
        updates, state = update(grads_at(params, step), state, params)
        params = optax.apply_updates(params, updates)
    manager.close()
    if mode == "save":
        print("written", json.dumps(written), flush=True)
    tx.close()
    shards = {}
    for leaf_index, leaf in enumerate(jax.tree.leaves(params)):
        for n, shard in enumerate(leaf.addressable_shards):
            starts = [s.start or 0 for s in shard.index]
            shards[f"{leaf_index}_{n}"] = np.asarray(shard.data)
            shards[f"{leaf_index}_{n}_at"] = np.array(starts, dtype=np.int64)
    np.savez(os.path.join(sys.argv[3], f"result{me}.npz"), **shards)
    print("done", flush=True)
    """
)


def spec_of(path) -> P:
    """The children's sharding of each leaf, on a mesh of axes ("proc", "local")."""
    name = jax.tree_util.keystr(path)
    if "big" in name:
        return P(("proc", "local"))  # FSDP over all 8 devices
    if "embed" in name or "w2" in name:
        return P("proc")  # split between processes, replicated inside each
    if "w1" in name:
        return P(None, "local")  # split inside each process, replicated across them
    return P()


def launch(tmp_path, mode: str, child: str = CHILD) -> list[subprocess.Popen]:
    """Two processes running ``child`` with arguments (coordinator, process id, tmp_path, mode, this folder)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    devices = 5 if mode == "jit" else 4
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return [
        subprocess.Popen(
            [sys.executable, "-u", "-c", child, f"127.0.0.1:{port}", str(i), str(tmp_path), mode, TESTS],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]


def finish(children: list[subprocess.Popen]) -> list[str]:
    outputs = []
    for child in children:
        out, err = child.communicate(timeout=400)
        assert child.returncode == 0 and "done" in out, err[-4000:]
        outputs.append(out)
    return outputs


def single_process_optax(restart_at: int | None) -> list[np.ndarray]:
    """In-memory optax over the children's 10 steps; at ``restart_at`` the params restart from the
    initial ones while the optimizer state carries on, as a resumed child's do."""
    inner = optax.adamw(1e-2, weight_decay=0.1)
    params = make_params()
    state = inner.init(params)
    for step in range(10):
        if step == restart_at:
            params = make_params()
        updates, state = inner.update(grads_at(params, step), state, params)
        params = optax.apply_updates(params, updates)
    return [np.asarray(x) for x in jax.tree.leaves(params)]


def assert_matches_single_process_optax(tmp_path, restart_at: int | None = None) -> None:
    expected = single_process_optax(restart_at)
    compared = 0
    for me in range(2):
        with np.load(tmp_path / f"result{me}.npz") as result:
            for key in (k for k in result.files if not k.endswith("_at")):
                leaf = int(key.split("_")[0])
                block, at = result[key], result[f"{key}_at"]
                want = expected[leaf][tuple(slice(a, a + n) for a, n in zip(at, block.shape, strict=True))]
                scale = max(float(np.max(np.abs(expected[leaf]))), 1e-30)
                assert float(np.max(np.abs(block - want))) / scale <= EXACT_BOUND, (me, key)
                compared += 1
    assert compared == 2 * 4 * len(expected)


def test_two_processes_match_single_process_optax(tmp_path):
    finish(launch(tmp_path, "train"))
    assert_matches_single_process_optax(tmp_path)
    for me in range(2):
        assert os.listdir(tmp_path / f"nvme{me}") == [f"proc{me:04d}"]
    assert sorted(os.listdir(tmp_path / "pfs")) == ["proc0000", "proc0001"]
    for me in range(2):
        assert any(name.startswith("sg") for name in os.listdir(tmp_path / "pfs" / f"proc{me:04d}"))


def test_two_processes_update_inside_jit(tmp_path):
    finish(launch(tmp_path, "jit"))
    assert_matches_single_process_optax(tmp_path)


def test_a_peer_killed_during_update_makes_the_survivor_fail_clearly(tmp_path):
    survivor, victim = launch(tmp_path, "die")
    while True:
        line = victim.stdout.readline()
        assert line, victim.stderr.read()[-4000:]
        if line.startswith("update 3"):
            break
    time.sleep(0.5)
    victim.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    _, err = survivor.communicate(timeout=120)
    elapsed = time.monotonic() - killed
    victim.wait(timeout=30)
    assert elapsed < 60, elapsed
    assert survivor.returncode != 0
    assert "PeerError" in err and "peer_timeout=10s" in err and "resume=True" in err, err[-4000:]

    # The survivor finished update 3, the victim did not: both resume at step 3, then train on.
    outputs = finish(launch(tmp_path, "resume"))
    assert all("init at 3" in out for out in outputs), outputs
    assert_matches_single_process_optax(tmp_path, restart_at=3)


def test_two_processes_save_a_sharded_checkpoint_that_restores_in_two_processes_and_in_one(tmp_path):
    """Saved at step 4 beside training by two processes; restored into two, and into one on a 1x8 mesh."""
    outputs = finish(launch(tmp_path, "save"))
    assert_matches_single_process_optax(tmp_path)
    layout = jax.tree.leaves(jax_mlp.standard_layout(optax.adamw(1e-2, weight_decay=0.1), make_params()))
    elements = [[0] * len(layout) for _ in outputs]
    for me, out in enumerate(outputs):
        for leaf, box in json.loads(re.search(r"^written (.*)$", out, re.MULTILINE).group(1)):
            elements[me][leaf] += math.prod(layout[leaf].shape if box is None else [b - a for a, b in box])
    print("elements each process wrote into the checkpoint:", elements)
    assert [a + b for a, b in zip(*elements, strict=True)] == [math.prod(x.shape) for x in layout], "not once"
    assert 0 < sum(elements[1]) < sum(elements[0]), "process 0 writes the replicas both hold and the shared leaves"
    outputs = finish(launch(tmp_path, "restore"))
    assert all("init at 4" in out for out in outputs), outputs
    assert_matches_single_process_optax(tmp_path)

    mesh = jax.make_mesh((1, 8), ("proc", "local"), devices=jax.devices()[:8])
    like = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec_of(path))),
        make_params(),
    )
    inner = optax.adamw(1e-2, weight_decay=0.1)
    with jax_mlp.mlp_offload(inner, paths=[tmp_path / "one"], subgroup_size="12KiB") as tx:
        with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
            restored = manager.restore(
                4,
                args=ocp.args.Composite(
                    params=ocp.args.StandardRestore(like), opt_state=jax_mlp.OffloadRestore(tx, like)
                ),
            )
        assert any(p.shard is not None for sg in tx.plan.subgroups for p in sg.pieces)
        params, _ = train(tx, restored["params"], restored["opt_state"], range(4, 10))
    assert_close_to_optax(jax.tree.leaves(params), single_process_optax(None))
