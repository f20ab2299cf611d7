"""``stream/state_stream.py``: ``StateStream``, one update as a transaction: ``check_step`` refuses a stale handle,
``abort`` leaves the previous step intact (cache, record locations, reads ahead), and ``end`` commits it with its
stats and ``on_stats``, whose failures are logged, not raised.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax
import pytest
from faults import inject_write_faults
from helpers import assert_same_bits, grads_at, make_params, run_offload, store, train

import jax_mlp
from jax_mlp._src.storage.paths import PathStore

SUBGROUP = "16KiB"


def stream_of(tx):
    """The ``StateStream`` of an initialised offload (a private attribute: the stream is the module under test)."""
    return tx._offloader.live.stream


def snapshot(stream, step):
    """A copy of every subgroup's fields at ``step`` as the tiers hold them, and where each stored record is."""
    fields = [stream.tiers.fetch(sg.index, step).fields for sg in stream.plan.subgroups]
    return [[[x.copy() for x in leaves] for leaves in held] for held in fields], stream.tiers.locations


def test_an_aborted_transaction_forgets_the_unfinished_step_and_the_previous_one_trains_on(paths):
    """What an update leaves before it fails (new records in the cache, a record moved to another path, reads
    ahead taken) is gone after ``abort``: the cache holds only the intact step, the locations are as before,
    and the next update gives the bits of a run that never failed."""
    params = make_params()
    options = {"subgroup_size": SUBGROUP, "host_cache": "40KiB", "placement": "round_robin", "rebalance": False}
    expected = run_offload(optax.adam(1e-2), params, 3, [paths[2]], **options)[0]
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=paths[:2], **options) as tx:
        current, state = train(tx, params, tx.init(params), range(2))
        stream = stream_of(tx)
        assert stream.prefetched, "the idle time read records ahead for update 2"
        fields, locations = snapshot(stream, 2)
        transaction = stream.begin()
        assert (transaction.step, transaction.locations) == (2, locations)
        assert transaction.ahead.keys(), "the reads ahead are handed to the transaction"
        # What the stream did before it failed: step 3 of a subgroup cached, and of another written elsewhere.
        cached, moved = stream.scheduler.order(2)[:2]
        store(stream.tiers, cached, fields[cached], 1024, 3, transaction.placement)
        stream.tiers.write(moved, fields[moved], 3, 1 - locations.paths[moved])
        assert stream.tiers.locations != locations and stream.tiers.cache.holds(cached, 3)
        stream.abort(transaction)
        assert stream.step == 2 and stream.tiers.locations == locations
        assert not any(stream.tiers.cache.holds(sg.index, 3) for sg in stream.plan.subgroups)
        assert transaction.ahead.keys() == () and stream.prefetched == (), "the reads ahead are settled"
        for index, (before, now) in enumerate(zip(fields, snapshot(stream, 2)[0], strict=True)):
            assert_same_bits(now, before, f"subgroup {index} at step 2")
        current, _ = train(tx, current, state, [2])
    assert_same_bits(current, expected)


def test_a_stale_opt_state_is_refused(paths):
    params = make_params()
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP) as tx:
        first = tx.init(params)
        _, _second = tx.update(grads_at(params, 0), first, params)
        with pytest.raises(jax_mlp.OffloadError, match="at step 0, but the offloaded state is at step 1"):
            tx.update(grads_at(params, 1), first, params)


@pytest.mark.parametrize("when", ["in its update", "after its update returned"])
def test_a_failed_write_loses_nothing_and_the_update_can_be_retried(paths, monkeypatch, when):
    """A record's write fails (a full disk) in the update, or after it, among the last ``write_depth`` writes that
    run on past its return. The error names the path, raised by the update itself or by the next call (here
    ``flush``); the record stays in memory, written once the disk has room, and training ends bit for bit as
    a run that never failed, also when resumed from the tiers alone."""
    params = make_params()
    options = dict(subgroup_size=SUBGROUP, host_cache=0)
    expected = run_offload(optax.adam(1e-2), params, 3, [paths[1]], **options)[0]

    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], **options) as tx:
        current, state = train(tx, params, tx.init(params), range(1))
        order = stream_of(tx).scheduler.order(1)
        assert len(order) > 4, "some writes in the update, the last write_depth=4 after it"
        failing = order[0] if when == "in its update" else order[-1]
        original_write = PathStore.write

        def failing_write(self, subgroup, slot, record):
            if subgroup == failing:
                raise jax_mlp.PathError(f"path {self.root} is full (no space left on device)")
            return original_write(self, subgroup, slot, record)

        monkeypatch.setattr(PathStore, "write", failing_write)
        if when == "in its update":
            with pytest.raises(jax_mlp.PathError, match=f"path {paths[0]} is full"):
                tx.update(grads_at(current, 1), state, current)
            assert tx.step == 1
        else:
            current, state = train(tx, current, state, [1])
            with pytest.raises(jax_mlp.PathError, match=f"path {paths[0]} is full"):
                tx.flush()
            assert tx.step == 2 and stream_of(tx).tiers.fetch(failing, 2).read is None, "kept in memory"
        monkeypatch.setattr(PathStore, "write", original_write)
        tx.flush()
        current, state = train(tx, current, state, range(int(tx.step), 3))
    assert_same_bits(current, expected)
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], resume=True, **options) as resumed:
        assert int(resumed.init(params).step) == 3


def test_a_fault_mid_stream_leaves_the_step_the_cache_and_the_locations_as_they_were(paths, monkeypatch):
    """Through a real update: a record write fails halfway through the stream (a full disk), and the stream
    aborts, so the offload's step, every cached record's step and every record's location are unchanged."""
    fault = inject_write_faults(monkeypatch)
    params = make_params()
    options = {"subgroup_size": SUBGROUP, "host_cache": "40KiB"}
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], **options) as tx:
        current, state = train(tx, params, tx.init(params), range(2))
        tx.flush()
        stream = stream_of(tx)
        fields, locations = snapshot(stream, 2)
        fault.fail(OSError(28, "No space left on device"))
        with pytest.raises(jax_mlp.PathError, match="is full"):
            train(tx, current, state, [2])
        fault.clear()
        assert tx.step == 2 and stream.tiers.locations == locations
        assert all(entry.step == 2 for _, entry in stream.tiers.cache.dirty())
        assert not any(stream.tiers.cache.holds(sg.index, 3) for sg in stream.plan.subgroups)
        for index, (before, now) in enumerate(zip(fields, snapshot(stream, 2)[0], strict=True)):
            assert_same_bits(now, before, f"subgroup {index} at step 2")


def test_stats_are_easy_to_log(paths):
    params = dict(make_params(), odd=jnp.ones((7, 13)))  # a shape no other test compiles
    logged = []
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP, on_stats=logged.append) as tx:
        state = tx.init(params)
        _, state = tx.update(grads_at(params, 0), state, params)
        assert [s.step for s in logged] == [0, 1]
        row = logged[-1].as_dict()
        assert row["step"] == 1 and row[f"bytes_read[{paths[0]}]"] > 0
        assert all(isinstance(v, (int, float)) for v in row.values())
        assert logged[0].compiles >= 1 and logged[-1].total_compiles >= logged[-1].compiles


def test_a_failing_stats_callback_does_not_lose_the_step(paths, caplog):
    def broken(stats):
        raise RuntimeError("logger is down")

    params = make_params()
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP, on_stats=broken) as tx:
        state = tx.init(params)
        for step in range(2):
            _, state = tx.update(grads_at(params, step), state, params)
        assert int(state.step) == 2
        assert "on_stats callback" in caplog.text
