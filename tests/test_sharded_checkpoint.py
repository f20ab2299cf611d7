"""Sharded checkpoints on 8 fake devices: saved from a 2x4 mesh, restored onto 2x4, 1x8 and 4x2 in a new process.

bf16 params with fp32 masters, FSDP and replicated leaves, two paths. The restores use other paths
and another subgroup size, and continue to the step the saving run reached; plain optax reads the
same checkpoint sharded, and a plain optax sharded checkpoint restores into ``mlp_offload``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from helpers import (
    abstract,
    assert_bf16_within_ulp,
    assert_close_to_optax,
    assert_same_bits,
    decay_mask,
    make_params,
    train,
)
from jax.sharding import NamedSharding
from test_sharding import mesh_2x4, spec_for

import jax_mlp
from jax_mlp._src.plan import remainders

TESTS = Path(__file__).resolve().parent
MESHES = [(2, 4), (1, 8), (4, 2)]


def inner():
    return optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask)


def sharded(tree, mesh):
    """``tree`` placed on ``mesh`` with test_sharding's specs: FSDP on 'fsdp', replicated on 'replica'."""
    return jax.tree_util.tree_map_with_path(lambda p, x: jax.device_put(x, NamedSharding(mesh, spec_for(p, x))), tree)


def like_on(mesh, tree):
    """``tree``'s ``jax.ShapeDtypeStruct``s, sharded on ``mesh`` as :func:`sharded` would place them."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec_for(p, x))), tree
    )


CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import jax, jax.numpy as jnp, numpy as np, optax, orbax.checkpoint as ocp
    import jax_mlp
    from helpers import grads_at, make_params, train
    from test_sharded_checkpoint import MESHES, inner, like_on

    root = sys.argv[2]
    assert len(jax.devices()) == 8
    bf16, fp32 = make_params(dtype=jnp.bfloat16), make_params()
    out, report = {}, {}

    def restore(directory, step, mesh, tree, opt_args):
        with ocp.CheckpointManager(directory) as manager:
            like = like_on(mesh, tree)
            restored = manager.restore(
                step, args=ocp.args.Composite(params=ocp.args.StandardRestore(like), opt_state=opt_args(like))
            )
        return restored["params"], restored["opt_state"]

    for shape in MESHES:  # other paths, another subgroup size and a host cache
        mesh = jax.make_mesh(shape, ("replica", "fsdp"))
        with jax_mlp.mlp_offload(inner(), paths=[f"{root}/new{shape[0]}x{shape[1]}"], subgroup_size="8KiB",
                                 host_cache="24KiB", master_dtype=jnp.float32) as tx:
            params, state = restore(f"{root}/offloaded", 4, mesh, bf16, lambda like: jax_mlp.OffloadRestore(tx, like))
            assert int(state.step) == 4, state
            assert all(p.sharding.mesh.devices.shape == shape for p in jax.tree.leaves(params))
            params, _ = train(tx, params, state, range(4, 8))
        out.update({f"{shape}/{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(params))})

    # Plain optax reads the offloaded checkpoint sharded, and continues on the fp32 masters.
    mesh = jax.make_mesh((4, 2), ("replica", "fsdp"))
    layout = jax_mlp.standard_layout(inner(), like_on(mesh, bf16), jnp.float32)
    with ocp.CheckpointManager(f"{root}/offloaded") as manager:
        at = {step: manager.restore(step, args=ocp.args.Composite(opt_state=ocp.args.StandardRestore(layout)))
              for step in (4, 8)}
    for want, got in zip(jax.tree.leaves(layout), jax.tree.leaves(at[4]["opt_state"]), strict=True):
        assert isinstance(got, jax.Array) and got.sharding.is_equivalent_to(want.sharding, got.ndim), (got, want)
    report["plain_sharded_leaves"] = len(jax.tree.leaves(at[4]["opt_state"]))
    masters, state = at[4]["opt_state"]["master"], at[4]["opt_state"]["opt_state"]
    for step in range(4, 8):
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads_at(jax.tree.map(lambda m: m.astype(jnp.bfloat16), masters), step))
        updates, state = inner().update(grads, state, masters)
        masters = optax.apply_updates(masters, updates)
    out.update({f"plain_masters/{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(masters))})
    out.update({f"offloaded_masters/{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(at[8]["opt_state"]["master"]))})

    # A plain optax sharded checkpoint restores into mlp_offload on another mesh.
    with jax_mlp.mlp_offload(inner(), paths=[f"{root}/from_plain"], subgroup_size="8KiB") as tx:
        params, state = restore(f"{root}/plain", 4, mesh, fp32, lambda like: jax_mlp.OffloadRestore(tx, like, step=4))
        params, _ = train(tx, params, state, range(4, 8))
    out.update({f"from_plain/{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(params))})
    np.savez(f"{root}/results.npz", **out)
    print(json.dumps(report))
    """
)


def test_a_sharded_checkpoint_round_trips_onto_other_meshes_paths_and_subgroups(tmp_path):
    mesh = mesh_2x4()
    params = sharded(make_params(dtype=jnp.bfloat16), mesh)
    # Full masters here, for restore_params; the restores below go into remainders.
    with jax_mlp.mlp_offload(
        inner(),
        paths=[tmp_path / "a", tmp_path / "b"],
        subgroup_size="16KiB",
        master_dtype=jnp.float32,
        master_storage="full",
    ) as tx:
        with ocp.CheckpointManager(tmp_path / "offloaded") as manager:
            state = tx.init(params)
            pieces = [p for sg in tx.plan.subgroups for p in sg.pieces]
            assert any(p.shard is not None and p.rows is not None for p in pieces), "no sharded leaf is split"
            params, state = train(tx, params, state, range(4))
            at_4 = params
            manager.save(
                4, args=ocp.args.Composite(params=ocp.args.StandardSave(params), opt_state=jax_mlp.OffloadSave(tx))
            )
            params, state = train(tx, params, state, range(4, 8))  # while the save streams out
            manager.save(8, args=ocp.args.Composite(opt_state=jax_mlp.OffloadSave(tx)))
        assert_same_bits(jax_mlp.restore_params(tx, abstract(params)), params, "restore_params of sharded tiers")
        restored_like = jax_mlp.restore_params(
            tx, like_on(jax.make_mesh((1, 8), ("replica", "fsdp"), devices=jax.devices()[:8]), params)
        )
        assert_same_bits(restored_like, params, "restore_params onto another mesh")
        assert {x.sharding.mesh.devices.shape for x in jax.tree.leaves(restored_like)} == {(1, 8)}
    at_8 = params

    plain = sharded(make_params(), mesh)
    with ocp.CheckpointManager(tmp_path / "plain") as manager:
        plain, plain_state = train(inner(), plain, inner().init(plain), range(4))
        manager.save(
            4,
            args=ocp.args.Composite(params=ocp.args.StandardSave(plain), opt_state=ocp.args.StandardSave(plain_state)),
        )
    plain, _ = train(inner(), plain, plain_state, range(4, 8))

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(TESTS), str(tmp_path)], capture_output=True, text=True, timeout=600, env=env
    )
    assert child.returncode == 0, child.stderr[-4000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["plain_sharded_leaves"] == len(jax.tree.leaves(inner().init(make_params()))) + len(
        jax.tree.leaves(params)
    )
    treedef = jax.tree.structure(at_8)

    def result(saved, name, count):  # np.savez keeps bfloat16 as raw 2-byte records
        leaves = [saved[f"{name}/{i}"] for i in range(count)]
        return jax.tree.unflatten(treedef, [x.view(jnp.bfloat16) if x.dtype.kind == "V" else x for x in leaves])

    n = treedef.num_leaves
    with np.load(tmp_path / "results.npz") as saved:
        restored = {shape: result(saved, str(shape), n) for shape in MESHES}
        plain_masters, offloaded_masters = result(saved, "plain_masters", n), result(saved, "offloaded_masters", n)
        from_plain = result(saved, "from_plain", n)
    moved = jax.tree.map(lambda a, b: np.asarray(a, np.float32) - np.asarray(b, np.float32), at_8, at_4)
    for shape, got in restored.items():
        assert_bf16_within_ulp(got, at_8, f"restored onto {shape[0]}x{shape[1]}, trained to step 8")
        displacement = jax.tree.map(lambda a, b: np.asarray(a, np.float32) - np.asarray(b, np.float32), got, at_4)
        off = sum(
            float(np.sum(np.abs(d - m)))
            for d, m in zip(jax.tree.leaves(displacement), jax.tree.leaves(moved), strict=True)
        )
        assert off <= 1e-3 * sum(float(np.sum(np.abs(m))) for m in jax.tree.leaves(moved)), (shape, off)
    assert max(float(np.max(np.abs(m))) for m in jax.tree.leaves(moved)) > 0.01, "training moved the params"
    compared = {
        "plain optax on the restored masters": (plain_masters, offloaded_masters),
        "plain sharded checkpoint into mlp_offload": (from_plain, plain),
    }
    print({what: assert_close_to_optax(*pair, what=what) for what, pair in compared.items()})


def test_sharded_remainder_masters_save_whole_and_restore_bitwise(tmp_path):
    """Remainder records of sharded params: the save rebuilds each block's fp32 master from that block
    of the params, and a restore on the same plan continues bit for bit."""
    mesh = mesh_2x4()
    params = sharded(make_params(dtype=jnp.bfloat16), mesh)
    options = {"subgroup_size": "16KiB", "master_dtype": jnp.float32, "master_storage": "remainder"}
    with (
        jax_mlp.mlp_offload(inner(), paths=[tmp_path / "a", tmp_path / "b"], **options) as tx,
        ocp.CheckpointManager(tmp_path / "ckpt") as manager,
    ):
        params, state = train(tx, params, tx.init(params), range(3))
        assert any(f.dtype == np.int16 for sg in tx.plan.subgroups for f in sg.layout.master_fields)
        manager.save(
            3, args=ocp.args.Composite(params=ocp.args.StandardSave(params), opt_state=jax_mlp.OffloadSave(tx, params))
        )
        at_6, _ = train(tx, params, state, range(3, 6))
    like = like_on(mesh, params)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        layout = jax_mlp.standard_layout(inner(), like, jnp.float32)
        masters = manager.restore(3, args=ocp.args.Composite(opt_state=ocp.args.StandardRestore(layout)))
    words = jax.tree.map(lambda m: remainders.split(jnp.asarray(m))[0], masters["opt_state"]["master"])
    assert_same_bits(words, params, "the saved masters' high halves are the params")
    with jax_mlp.mlp_offload(inner(), paths=[tmp_path / "c"], **options) as resumed:
        with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
            restored = manager.restore(
                3,
                args=ocp.args.Composite(
                    params=ocp.args.StandardRestore(like), opt_state=jax_mlp.OffloadRestore(resumed, like)
                ),
            )
        continued, _ = train(resumed, restored["params"], restored["opt_state"], range(3, 6))
    assert_same_bits(continued, at_6, "restored remainders continue bit for bit")


def test_a_chunk_never_spans_two_blocks_and_follows_the_row_chunks_where_they_leave_it_large():
    from jax_mlp._src.checkpoint.layout import chunk_shape

    def fsdp(rows, cols, parts):  # blocks of ``parts`` equal row ranges
        step = rows // parts
        return [((i * step, (i + 1) * step), (0, cols)) for i in range(parts)]

    # Row chunks of 256 rows of 4 KiB inside 1024-row blocks: 1 MiB chunks on every boundary.
    assert chunk_shape((4096, 1024), 4, fsdp(4096, 1024, 4), 256) == (256, 1024)
    # Row chunks of 16 rows would make 64 KiB chunks: a block's rows, the largest divisor within 4 MiB.
    assert chunk_shape((256, 1024), 4, fsdp(256, 1024, 4), 16) == (64, 1024)
    assert chunk_shape((8192, 1024), 4, fsdp(8192, 1024, 2), 48) == (1024, 1024)
    # Blocks over columns and a leaf on one device.
    assert chunk_shape((16, 32), 4, [((0, 16), (c, c + 8)) for c in range(0, 32, 8)], 0) == (16, 8)
    assert chunk_shape((40, 16), 2, [], 0) == (40, 16) and chunk_shape((), 4, [], 0) == ()
