"""``offload/in_jit.py``: ``update`` traced inside ``jax.jit`` and ``nnx.jit``: per-device host callbacks inside
``shard_map``.
"""

from __future__ import annotations

import logging
import threading

import jax
import optax
import pytest
from helpers import OPTIMIZERS, assert_close_to_optax, grads_at, make_params, train
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_flax import train as train_nnx
from test_sharding import assert_stored_once, mesh_2x4, sharded_params, train_keeping_shardings

import jax_mlp
from jax_mlp._src.offload import in_jit


def jitted_training(tx, params, steps: int):
    @jax.jit
    def step_fn(params, opt_state, step):
        updates, opt_state = tx.update(grads_at(params, step), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    for step in range(steps):
        params, opt_state = step_fn(params, opt_state, step)
    return params, opt_state


def eager_optax(inner, params, steps: int):
    return train(inner, params, inner.init(params), range(steps))[0]


def test_update_inside_jit_matches_optax(tmp_path):
    params = make_params()
    inner = OPTIMIZERS["adamw_mask"]()
    with jax_mlp.mlp_offload(inner, paths=[tmp_path / "a", tmp_path / "b"], subgroup_size="24KiB") as tx:
        got, opt_state = jitted_training(tx, params, steps=10)
        assert int(opt_state.step) == 10 and tx.stats.step == 10
        assert len(tx.plan.subgroups) > 8
        expected = eager_optax(inner, params, steps=10)
        assert_close_to_optax(got, expected)


def test_sharded_update_inside_jit_matches_optax_keeps_shardings_and_stores_once(tmp_path):
    mesh = mesh_2x4()
    params = sharded_params(mesh)
    inner = OPTIMIZERS["adamw_mask"]()
    with jax_mlp.mlp_offload(inner, paths=[tmp_path / "a", tmp_path / "b"], subgroup_size="24KiB") as tx:
        params = train_keeping_shardings(tx, inner, params, jax.jit(tx.update))
        assert tx.jit_layout.host not in mesh.devices.flat, "the update must run outside the mesh"
        assert_stored_once(tx, inner, params)


def test_many_jitted_updates_queued_ahead_all_run_before_close(tmp_path):
    """40 steps dispatched before any finishes (more than XLA's in-flight programs per device), then close."""
    params = sharded_params(mesh_2x4())
    inner = optax.adam(1e-2)
    with jax_mlp.mlp_offload(inner, paths=tmp_path, subgroup_size="24KiB") as tx:
        step_fn = jax.jit(lambda p, s: _apply(tx, p, s, grads_at(p, 0)))
        opt_state = tx.init(params)
        for _ in range(40):
            params, opt_state = step_fn(params, opt_state)
        tx.close()  # waits for the queued updates
    assert tx.stats.step == 40 and int(opt_state.step) == 40
    expected = jax.jit(lambda p, s: _apply(inner, p, s, grads_at(p, 0)))
    reference, state = sharded_params(mesh_2x4()), inner.init(params)
    for _ in range(40):
        reference, state = expected(reference, state)
    assert_close_to_optax(params, reference)


def _apply(tx, params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def test_layouts_the_cpu_runtime_cannot_serve_are_refused_at_trace_time(tmp_path, monkeypatch):
    every_device = jax.make_mesh((len(jax.devices()),), ("all",))
    replicated = {"w": jax.device_put(make_params()["big"], NamedSharding(every_device, P()))}
    mixed = {"w": replicated["w"], "b": jax.numpy.zeros(3)}
    cases = [(replicated, "one more CPU device"), (mixed, r"param \['b'\] is on one device")]
    monkeypatch.setenv("NPROC", "4")
    cases.append((sharded_params(mesh_2x4()), "needs 17 XLA CPU threads .* has 9; set NPROC=17"))
    for index, (params, message) in enumerate(cases):
        with jax_mlp.mlp_offload(optax.adam(1e-2), paths=tmp_path / str(index)) as tx:
            opt_state = tx.init(params)
            with pytest.raises(jax_mlp.OffloadError, match=message):
                jax.jit(tx.update)(grads_at(params, 0), opt_state, params)
            _, opt_state = tx.update(grads_at(params, 0), opt_state, params)  # the eager route still works
            assert int(opt_state.step) == 1


def test_rendezvous_times_out_clearly_and_hands_every_party_the_error():
    rendezvous = in_jit.Rendezvous(parties=2, timeout=0.5)
    with pytest.raises(jax_mlp.OffloadError, match="1 of 2 devices' callbacks did not arrive"):
        rendezvous.meet(7, party=0, payload=None, work=lambda payloads: payloads)

    def fail(payloads):
        raise RuntimeError(f"update failed with {sorted(payloads)}")

    errors = []

    def party(index):
        try:
            rendezvous.meet(8, party=index, payload=index, work=fail)
        except RuntimeError as error:
            errors.append(str(error))

    threads = [threading.Thread(target=party, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert errors == ["update failed with [0, 1]"] * 2
    results = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(rendezvous.meet(9, i, i * 10, dict))) for i in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert results == [{0: 0, 1: 10}] * 2


def test_jit_and_eager_updates_interleave_on_one_state(tmp_path):
    params = make_params()
    inner = optax.adam(1e-2)
    with jax_mlp.mlp_offload(inner, paths=tmp_path, subgroup_size="24KiB") as tx:
        opt_state = tx.init(params)
        jitted = jax.jit(tx.update)
        for step in range(4):
            update = jitted if step % 2 else tx.update
            updates, opt_state = update(grads_at(params, step), opt_state, params)
            params = optax.apply_updates(params, updates)
        expected = eager_optax(inner, make_params(), steps=4)
        assert_close_to_optax(params, expected)


@pytest.mark.parametrize("layout", ["one_device", "sharded"])
def test_a_failed_jitted_update_asks_for_resume(tmp_path, layout):
    params = make_params() if layout == "one_device" else sharded_params(mesh_2x4())
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=tmp_path) as tx:
        opt_state = tx.init(params)
        stale = jax.tree.map(lambda x: x, opt_state)
        jitted = jax.jit(tx.update)
        _, opt_state = jitted(grads_at(params, 0), opt_state, params)
        with pytest.raises(Exception, match="step 0, but the offloaded state is at step 1"):
            jax.block_until_ready(jitted(grads_at(params, 1), stale, params))
        with pytest.raises(Exception, match="resume=True"):
            jax.block_until_ready(jitted(grads_at(params, 1), opt_state, params))
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=tmp_path, resume=True) as resumed:
        assert int(resumed.init(params).step) == 1


def test_nnx_optimizer_update_inside_nnx_jit(tmp_path):
    inner = optax.adamw(1e-2, weight_decay=0.1)
    with jax_mlp.mlp_offload(inner, paths=tmp_path, subgroup_size="2KiB") as offload:
        got = train_nnx(optax.chain(optax.clip_by_global_norm(1.0), offload), 8, update_in_jit=True)
        assert offload.stats.step == 8 and len(offload.plan.subgroups) >= 3
    expected = train_nnx(optax.chain(optax.clip_by_global_norm(1.0), inner), 8, update_in_jit=True)
    assert_close_to_optax(jax.tree.leaves(got), jax.tree.leaves(expected))


def test_the_traced_route_says_once_where_it_runs(tmp_path, caplog):
    """The first traced ``update`` logs, on the ``jax_mlp`` logger, that it runs on the host CPU; later traces don't."""
    params = make_params()
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=tmp_path) as tx:
        opt_state = tx.init(params)
        with caplog.at_level(logging.INFO, logger="jax_mlp"):
            _, opt_state = jax.jit(tx.update)(grads_at(params, 0), opt_state, params)
            _, opt_state = jax.jit(lambda g, s, p: tx.update(g, s, p))(grads_at(params, 1), opt_state, params)
            tx.update(grads_at(params, 2), opt_state, params)  # eager: nothing to say
    said = [r for r in caplog.records if r.name.startswith("jax_mlp") and "runs on the host CPU" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert said[0].levelno == logging.INFO  # CPU devices: both routes run the update on the same CPU
    assert "split step is faster" in said[0].getMessage()
