"""``stream/idle.py``: ``IdleIO``, the I/O between updates: dirty cached records written back (``flush="idle"``,
or only when asked with ``"lazy"``), the next update's first uncached records read ahead (further during an
accumulation window), ``flush``, and a failed write-back raised by the next call.

The first tests drive a real ``IdleIO`` on a real tier stack, engine and scheduler; the others an offload.
"""

from __future__ import annotations

import errno
import os

import optax
import pytest
from faults import inject_write_faults
from helpers import assert_same_bits, fields_of, grads_at, make_params, run_offload, store, train

import jax_mlp
from jax_mlp._src.config import OffloadConfig
from jax_mlp._src.schedule.performance import PathSpeed
from jax_mlp._src.schedule.scheduler import Scheduler
from jax_mlp._src.stats import IOCounters
from jax_mlp._src.storage import record
from jax_mlp._src.storage.record import HEADER_SIZE
from jax_mlp._src.stream.engine import Engine
from jax_mlp._src.stream.idle import IdleIO

SUBGROUP = "16KiB"


@pytest.fixture
def make_idle(make_tiers, tmp_path):
    """Makes an ``IdleIO`` of the given options on a real tier stack of four subgroups and two paths; the fetch it
    reads ahead with counts each read, as the stream's does. Closes the engines after the test."""
    engines = []

    def make(host_cache, **options):
        tiers, plan = make_tiers(host_cache)
        config = OffloadConfig([tmp_path / "p0", tmp_path / "p1"], host_cache=host_cache, **options)
        sizes = [HEADER_SIZE + sg.layout.nbytes for sg in plan.subgroups]
        scheduler = Scheduler(sizes, [PathSpeed("p0", 1e9, 1e9), PathSpeed("p1", 1e9, 1e9)], rebalance=False)
        engines.append(Engine(config.prefetch_depth, config.write_depth, config.io_timeout))
        counters = IOCounters([path.root for path in tiers.paths])

        def fetch(index, step):
            fetched = tiers.fetch(index, step)
            if fetched.read is None:
                counters.hit()
            else:
                counters.count(fetched.read)
            return fetched.fields

        return IdleIO(config, scheduler, tiers, engines[-1], counters, fetch), plan

    yield make
    for engine in engines:
        engine.close()


def fill(idle, plan, step, cached=()):
    """Step ``step`` of every subgroup: the ones in ``cached`` dirty in the cache, the others on their path."""
    placement = idle.scheduler.placement
    for sg in plan.subgroups:
        fields = fields_of(sg.layout, step + sg.index / 10)
        if sg.index in cached:
            store(idle.tiers, sg.index, fields, HEADER_SIZE + sg.layout.nbytes, step, placement)
        else:
            idle.tiers.write(sg.index, fields, step, placement[sg.index])


@pytest.mark.parametrize("flush", ["idle", "lazy"])
def test_idle_write_back_writes_every_dirty_record_to_its_placement_and_counts_it(make_idle, flush):
    idle, plan = make_idle(host_cache=10 * 640, flush=flush, idle_prefetch=False)
    fill(idle, plan, 3, cached=(0, 1, 2))
    idle.after_update(3)
    idle.engine.wait_background()
    dirty = [k for k, _ in idle.tiers.cache.dirty()]
    written = idle.counters.bytes_written
    if flush == "lazy":
        assert dirty == [0, 1, 2] and sum(written.values()) == 0, "lazy: written only when asked"
        idle.flush()
        dirty, written = [k for k, _ in idle.tiers.cache.dirty()], idle.counters.bytes_written
    assert dirty == []
    placement, roots = idle.scheduler.placement, [path.root for path in idle.tiers.paths]
    assert written == {roots[p]: 640 * [placement[k] for k in (0, 1, 2)].count(p) for p in (0, 1)}
    for k in (0, 1, 2):  # complete on storage at step 3, in the slot and on the path the placement says
        assert idle.tiers.paths[placement[k]].verified_step(k, 3 % 2, plan.layout_hash) == 3


@pytest.mark.parametrize("depth", [1, 2])
def test_idle_read_ahead_reads_the_next_updates_first_uncached_records(make_idle, depth):
    idle, plan = make_idle(host_cache=10 * 640, prefetch_depth=depth, flush="lazy")
    fill(idle, plan, 4, cached=(0,))  # step 4 goes in ascending order: 0 is cached, 1 and 2 come next
    idle.after_update(4)
    assert idle.scheduler.order(4)[: depth + 1] == list(range(depth + 1))
    assert idle.prefetched == tuple(range(1, depth + 1))
    ahead = idle.take_ahead()
    assert idle.prefetched == (), "taken by the update that starts now"
    for k in range(1, depth + 1):
        assert_same_bits(idle.engine.result(ahead.take(k), "reading"), fields_of(plan.subgroups[k].layout, 4 + k / 10))
    assert sum(idle.counters.bytes_read.values()) == 640 * depth and idle.counters.cache_hits == 0


def test_an_accumulation_window_reads_further_ahead_once_the_write_back_has_drained(make_idle):
    idle, plan = make_idle(host_cache=0, prefetch_depth=1, write_depth=2)
    fill(idle, plan, 5)  # step 5 goes in descending order
    idle.after_update(5)
    assert idle.prefetched == (3,)
    idle.use_window(5)
    assert idle.engine.background_done()
    assert idle.prefetched == (3, 2, 1), "prefetch_depth + write_depth records, each read once"


def test_without_idle_prefetch_nothing_is_read_ahead(make_idle):
    idle, plan = make_idle(host_cache=0, idle_prefetch=False)
    fill(idle, plan, 1)
    idle.after_update(1)
    idle.use_window(1)
    assert idle.prefetched == () and sum(idle.counters.bytes_read.values()) == 0


def test_idle_prefetch_reads_the_next_updates_first_records_once(paths):
    """The idle-time reads ahead start with the next update's first records. Those the last update wrote last,
    whose writes run on past it (its last ``write_depth``, the first of the alternating order), are taken from
    memory as hits; the next ``prefetch_depth`` are read; the update reads the rest; none is read twice."""
    params = make_params()
    with jax_mlp.mlp_offload(
        optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP, prefetch_depth=3, write_depth=2
    ) as tx:
        state = tx.init(params)
        offloader = tx
        assert sorted(offloader.prefetched) == sorted(offloader.scheduler.order(0)[:3]), "init's writes all landed"
        sizes = [HEADER_SIZE + sg.layout.nbytes for sg in offloader.plan.subgroups]
        assert len(sizes) > 5
        for step in range(3):
            _, state = tx.update(grads_at(params, step), state, params)
            ran_on = [] if step == 0 else offloader.scheduler.order(step)[:2]
            assert sorted(ran_on) == sorted(offloader.scheduler.order(step - 1)[-2:] if step else [])
            assert tx.stats.cache_hits == len(ran_on)
            assert sum(tx.stats.bytes_read.values()) == sum(sizes) - sum(sizes[k] for k in ran_on)
            assert sorted(offloader.prefetched) == sorted(offloader.scheduler.order(step + 1)[:5])


def test_lazy_flush_writes_cached_records_only_when_asked(paths, monkeypatch):
    params = make_params()
    with jax_mlp.mlp_offload(
        optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP, host_cache="8MiB", flush="lazy"
    ) as tx:
        state = tx.init(params)
        packed = []
        pack = record.pack
        monkeypatch.setattr(record, "pack", lambda layout, *args: packed.append(layout) or pack(layout, *args))
        for step in range(3):
            _, state = tx.update(grads_at(params, step), state, params)
            assert sum(tx.stats.bytes_written.values()) == 0
            assert packed == [], "cached state is kept as arrays, never packed into a record"
        tx.flush()
        assert len(packed) == len(tx.plan.subgroups), "flush packs each subgroup's record once"
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP, resume=True) as resumed:
        assert int(resumed.init(params).step) == 3


def test_the_idle_write_back_is_counted_in_the_next_updates_stats(paths):
    """A cache that holds the whole state: an update reads and writes nothing itself; each update's stats count
    the previous step's records written back in idle time (all of them with ``"idle"``, none with ``"lazy"``)."""
    params = make_params()
    for flush, path in (("idle", paths[0]), ("lazy", paths[1])):
        with jax_mlp.mlp_offload(
            optax.adam(1e-2), paths=[path], subgroup_size=SUBGROUP, host_cache="8MiB", flush=flush
        ) as tx:
            state = tx.init(params)
            subgroups = tx.plan.subgroups
            every_record = sum(HEADER_SIZE + sg.layout.nbytes for sg in subgroups)
            for step in range(3):
                params, state = train(tx, params, state, [step])
                stats = tx.stats
                assert sum(stats.bytes_read.values()) == 0 and stats.cache_hits == len(subgroups)
                assert sum(stats.bytes_written.values()) == (every_record if flush == "idle" else 0), (flush, step)


def test_a_failed_write_back_is_raised_by_the_next_flush_and_update_and_loses_nothing(paths, monkeypatch):
    """The write-back runs after the update returns, so its error comes with the next call; the dirty records
    stay cached, and once the path has room again they are written and training goes on, bit for bit."""
    fault = inject_write_faults(monkeypatch)
    options = {"subgroup_size": SUBGROUP, "host_cache": "8MiB"}  # every record stays cached: updates write nothing
    params = make_params()
    expected = run_offload(optax.adam(1e-2), params, 3, [paths[1]], **options)[0]
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], **options) as tx:
        current, state = train(tx, params, tx.init(params), range(1))
        tx.flush()  # step 1 is on the path before it fills
        fault.fail(full)
        current, state = train(tx, current, state, [1])  # its own records go to the cache: it succeeds
        with pytest.raises(jax_mlp.PathError, match=rf"path {paths[0]} is full"):
            train(tx, current, state, [2])  # the write-back of step 2 failed meanwhile
        assert tx.step == 2
        with pytest.raises(jax_mlp.PathError, match=rf"path {paths[0]} is full"):
            tx.flush()  # tried again: the path is still full
        fault.clear()
        tx.flush()
        current, state = train(tx, current, state, [2])
    assert_same_bits(current, expected)
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], resume=True, **options) as resumed:
        assert int(resumed.init(params).step) == 3, "the tiers hold the last step complete"
