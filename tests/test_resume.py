"""``offload/resume.py``: a run's identity (``run.json`` and its plan), what a directory may hold for ``init`` or
``resume=True`` (another run or layout is refused naming the first difference), and resuming after ``close``
(which flushes; ``close(delete=True)`` removes the files instead) or after a failed resume.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_same_bits, grads_at, make_params, run_offload, train

import jax_mlp
from jax_mlp._src.offload import planning

SUBGROUP = "16KiB"


def test_a_second_run_on_the_same_directory_names_both_ways_on(paths):
    params = make_params()
    run_offload(optax.adam(1e-2), params, 3, [paths[0]], subgroup_size=SUBGROUP)
    with (
        pytest.raises(jax_mlp.OffloadError) as refused,
        jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP) as second,
    ):
        second.init(params)
    message = str(refused.value)
    assert f"path {paths[0]} already holds this run's offloaded optimizer state" in message
    assert "newest record is of step 3" in message
    assert "resume=True" in message and "OffloadRestore" in message
    # Nothing was written: the run resumes at its step.
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP, resume=True) as resumed:
        assert int(resumed.init(params).step) == 3


def _refusal(paths, params, inner=None, **options):
    options = {"subgroup_size": SUBGROUP, **options}
    with (
        pytest.raises(jax_mlp.RecordError, match="another run or subgroup layout") as refused,
        jax_mlp.mlp_offload(inner or optax.adam(1e-2), paths=[paths[0]], **options) as tx,
    ):
        tx.init(params)
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
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP, resume=True) as tx:
        assert int(tx.init(params).step) == 1


def test_context_manager_flushes_and_delete_removes_files(paths):
    params = make_params()
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP, host_cache="1MiB") as tx:
        state = tx.init(params)
        tx.update(grads_at(params, 0), state, params)
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP, resume=True) as resumed:
        assert int(resumed.init(params).step) == 1
        resumed.close(delete=True)
    assert not paths[0].exists()


def test_a_failed_resume_leaves_the_directory_usable(paths):
    params = make_params()
    with (
        pytest.raises(jax_mlp.OffloadError, match=r"no path .* holds offloaded optimizer state"),
        jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], resume=True) as resumed,
    ):
        resumed.init(params)
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]]) as tx:
        assert int(tx.init(params).step) == 0


def test_a_run_planned_in_tree_order_resumes_in_it(paths, monkeypatch):
    # Before 0.3 a plan packed the leaves in the flattened tree's order (l0, l1, l10, ...) and run.json did
    # not name the order: such a run resumes in that order, bitwise as if it had never stopped.
    params = {f"l{i}": jax.random.normal(jax.random.key(i), (32, 32)) for i in range(12)}
    options = {"subgroup_size": "24KiB"}
    expected, _ = run_offload(optax.adam(1e-2), params, 4, [paths[1]], **options)
    make_plan = planning.partition.make_plan
    monkeypatch.setattr(
        planning.partition, "make_plan", lambda *args, leaf_order, **kw: make_plan(*args, leaf_order="tree", **kw)
    )
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], **options) as tx:
        trained, _ = train(tx, params, tx.init(params), range(2))
        old = tx._offloader.live.plan
    monkeypatch.undo()
    (run_file,) = Path(paths[0]).glob("*/run.json")
    identity = json.loads(run_file.read_text())
    del identity["plan"]["leaf_order"]  # as 0.2 wrote it
    run_file.write_text(json.dumps(identity))
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], **options, resume=True) as tx:
        state = tx.init(trained)
        assert tx._offloader.live.plan.layout_hash == old.layout_hash
        assert tx._offloader.live.plan.layout_hash != tx._offloader.plan_for(params).layout_hash
        assert int(state.step) == 2
        resumed, _ = train(tx, trained, state, range(2, 4))
    assert_same_bits(resumed, expected)
    assert "packed into subgroups in tree order, this offload's in natural order" in _refusal(paths, params, **options)
