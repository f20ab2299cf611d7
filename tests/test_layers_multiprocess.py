"""``jax_mlp.stream_layers`` over two real ``jax.distributed`` processes on 127.0.0.1, 4 CPU devices each: the layers
sharded over a mesh of all 8 (FSDP over processes), each process streaming its own shards."""

from __future__ import annotations

import os
import re
import signal
import textwrap
import time

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from helpers import assert_close_to_optax, assert_same_bits
from test_layers import LAYERS, model
from test_layers import whole_model_in_optax as in_optax
from test_multiprocess import finish, launch

import jax_mlp

CLIP, STEPS, KILLED_AT, SAVED_AT = 6.0, 4, 2, 2  # the clipping fires in some steps (the children count the redos)

CHILD = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, sys.argv[5])
    import jax, numpy as np
    # A dead peer leaves the survivor waiting in a layer program's collective: jax.distributed ends it.
    jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]), heartbeat_timeout_seconds=10)
    import optax, orbax.checkpoint as ocp, jax_mlp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from test_layers import STACK, batch_at, model
    from test_layers_multiprocess import CLIP, SAVED_AT, STEPS

    mesh = Mesh(np.array(jax.devices()), ("fsdp",))  # 4 devices of each process

    def put(x, spec):
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])

    outer, stacked = jax.tree.map(np.asarray, model())
    me, root, mode = jax.process_index(), sys.argv[3], sys.argv[4]
    paths = [os.path.join(root, f"nvme{me}"), os.path.join(root, "pfs")]
    if mode == "die":  # slow paths, so that a kill lands in the middle of a step
        paths = [jax_mlp.Path(p, max_read="10KB/s", max_write="10KB/s") for p in paths]
    if mode == "restore":  # the checkpoint of step SAVED_AT, into other paths
        paths = [os.path.join(root, f"restored{me}")]
    clipping = "defer" if mode in ("die", "resume") else "speculate"  # the killed run defers each update
    stream = lambda: jax_mlp.stream_layers(  # noqa: E731
        STACK, optax.adam(1e-2), max_grad_norm=CLIP, clipping=clipping, microbatches=2, paths=paths, peer_timeout=10,
        subgroup_size="512B", resume=mode == "resume",
    )
    if mode == "train":  # a leaf on one device cannot join the layer programs of two processes
        try:
            stream().init(outer, jax.tree.map(lambda x: put(x, P(None, "fsdp")), stacked))
        except jax_mlp.OffloadError as error:
            print("refused:", error, flush=True)
    outer = {"embedding": put(outer["embedding"], P(None, "fsdp")), "out": put(outer["out"], P())}
    stacked = jax.tree.map(lambda x: put(x, P(None, "fsdp")), stacked)
    manager = ocp.CheckpointManager(os.path.join(root, "checkpoints"))  # each process saves the blocks it holds
    with stream() as run:
        if mode == "restore":
            like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), (outer, stacked))
            state = manager.restore(SAVED_AT, args=ocp.args.Composite(model=jax_mlp.OffloadRestore(run, like)))["model"]
        else:
            state = run.init(outer, stacked)
        print("init at", int(state.step), flush=True)
        for step in range(int(state.step), STEPS):
            if mode == "train" and step == SAVED_AT:  # saved while training goes on
                manager.save(step, args=ocp.args.Composite(model=jax_mlp.OffloadSave(run)))
            print("step", step, flush=True)
            _, state = run.step(state, batch_at(step))
        print("rolled back", run.rolled_back, flush=True)
        if mode == "train":
            manager.save(STEPS, args=ocp.args.Composite(model=jax_mlp.OffloadSave(run)))
        manager.close()
        blocks = {}
        for index, leaf in enumerate(jax.tree.leaves(run.params())):
            for n, shard in enumerate(leaf.addressable_shards):
                blocks[f"{index}_{n}"] = np.asarray(shard.data)
                blocks[f"{index}_{n}_at"] = np.array([s.start or 0 for s in shard.index], dtype=np.int64)
    np.savez(os.path.join(root, f"{'restored' if mode == 'restore' else 'result'}{me}.npz"), **blocks)
    print("done", flush=True)
    """
)


def gathered(tmp_path, name="result"):
    """The children's params, each leaf put together from the blocks both processes hold."""
    start = jax.tree.leaves(model())
    leaves = [np.full(x.shape, np.nan, np.float32) for x in start]
    for me in range(2):
        with np.load(tmp_path / f"{name}{me}.npz") as result:
            for key in (k for k in result.files if not k.endswith("_at")):
                block, at = result[key], result[f"{key}_at"]
                leaves[int(key.split("_")[0])][tuple(slice(a, a + n) for a, n in zip(at, block.shape, strict=True))] = (
                    block
                )
    assert not any(np.isnan(x).any() for x in leaves), "an element neither process holds"
    return jax.tree.unflatten(jax.tree.structure(model()), leaves)


def assert_as_the_whole_model_in_optax(tmp_path):
    outer, stacked = model()
    inner = optax.chain(optax.clip_by_global_norm(CLIP), optax.adam(1e-2))
    assert_close_to_optax(gathered(tmp_path), in_optax(inner, outer, stacked, range(STEPS)), (outer, stacked))


def test_two_processes_stream_their_shards_and_train_as_the_whole_model_in_optax(tmp_path):
    """Each process reads and updates its own shards of each layer (its records on its own paths); the layer
    programs gather across processes; the clipping fires and is redone in both; micro-batches layer-major. Each
    process saves the blocks it holds: restored into two processes on other paths, the run ends bitwise."""
    outputs = finish(launch(tmp_path, "train", CHILD))
    for out in outputs:
        assert "refused: with 2 jax processes" in out and "['outer']['embedding'] is on one device" in out, out
        rolled_back = int(out.split("rolled back ")[1].split()[0])
        assert 0 < rolled_back < STEPS, out
    for me in range(2):
        assert os.listdir(tmp_path / f"nvme{me}") == [f"proc{me:04d}"]
    assert sorted(os.listdir(tmp_path / "pfs")) == ["proc0000", "proc0001"]
    assert_as_the_whole_model_in_optax(tmp_path)

    # The checkpoint both saved, restored in this one process: the params they held, bit for bit.
    outer, stacked = gathered(tmp_path)
    tree = {"layers": [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(LAYERS)], "outer": outer}
    layout = jax_mlp.standard_layout(optax.adam(1e-2), tree, with_params=True)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "checkpoints" / str(STEPS) / "model", layout)
    assert_same_bits(restored["params"], tree, "the params two processes saved")
    assert int(restored["opt_state"][0].count) == STEPS

    outputs = finish(launch(tmp_path, "restore", CHILD))  # the checkpoint saved beside training, at SAVED_AT
    assert all(f"init at {SAVED_AT}" in out for out in outputs), outputs
    assert_same_bits(gathered(tmp_path, "restored"), (outer, stacked), "restored into two processes")


def test_a_peer_killed_mid_step_ends_the_survivor_and_both_resume_from_the_tiers(tmp_path):
    """A peer killed with ``kill -9`` in the middle of step 2, updates deferred to the next forward: the survivor,
    waiting in a layer program's collective, is ended by jax.distributed's heartbeat (it does not hang);
    restarted, both resume at the last step every process committed (the deferred update of step 1 runs in step
    2's forward: 1 or 2) and end as the whole model in optax."""
    survivor, victim = launch(tmp_path, "die", CHILD)
    while True:
        line = victim.stdout.readline()
        assert line, victim.stderr.read()[-4000:]
        if line.startswith(f"step {KILLED_AT}"):
            break
    time.sleep(0.3)
    victim.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    _, err = survivor.communicate(timeout=120)
    victim.wait(timeout=30)
    assert time.monotonic() - killed < 60
    assert survivor.returncode != 0, err[-4000:]
    outputs = finish(launch(tmp_path, "resume", CHILD))
    resumed = {int(re.search(r"^init at (\d+)$", out, re.MULTILINE).group(1)) for out in outputs}
    assert len(resumed) == 1 and resumed <= {KILLED_AT - 1, KILLED_AT}, outputs
    assert_as_the_whole_model_in_optax(tmp_path)
