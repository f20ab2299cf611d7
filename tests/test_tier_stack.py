"""``storage/tier_stack.py``: ``TierStack``, the host cache in front of the paths (fetch, store, write, write-back),
where each record lives (``Locations``: moves, ``restore``, ``drop_moved``) and ``Pin``; and the bytes an update
moves through it without a cache.

The stacks here are real: a ``HostCache`` and two held directories (the ``make_tiers`` fixture), with sealed
records of a small plan's layouts.
"""

from __future__ import annotations

import threading

import optax
import pytest
from helpers import assert_same_bits, fields_of, grads_at, make_params, store

import jax_mlp
from jax_mlp._src.storage.cache import CacheEntry
from jax_mlp._src.storage.record import HEADER_SIZE

SUBGROUP = "16KiB"
WAIT = 30.0
"""Seconds a test waits for another thread before it gives up: a bound on a hang, never a measure."""


def record_bytes(tx) -> int:
    return sum(HEADER_SIZE + sg.layout.nbytes for sg in tx.plan.subgroups)


def record_size(plan, index=0) -> int:
    """The size of subgroup ``index``'s record, header included."""
    return HEADER_SIZE + plan.subgroups[index].layout.nbytes


def test_without_cache_each_record_is_written_once_per_update_and_read_unless_still_in_memory(paths):
    """With no host cache every record is written once a step. An update's last ``write_depth`` writes run on past
    it, counted in the next update's stats, and the next update takes those records from memory (the alternating
    order starts with them): it reads only the others."""
    params = make_params()
    with jax_mlp.mlp_offload(
        optax.adam(1e-2), paths=paths[:2], subgroup_size=SUBGROUP, host_cache=0, write_depth=2
    ) as tx:
        state = tx.init(params)
        assert sum(tx.stats.bytes_written.values()) == record_bytes(tx)
        sizes = [record_size(tx.plan, sg.index) for sg in tx.plan.subgroups]
        for step in range(3):
            _, state = tx.update(grads_at(params, step), state, params)
            stats, order = tx.stats, tx.scheduler.order(step)
            ran_on = order[-2:]  # this update's, counted by the next
            held = [] if step == 0 else order[:2]  # the last update's, taken from memory
            assert stats.cache_hits == len(held)
            assert stats.cache_misses == len(sizes) - len(held)
            assert sum(stats.bytes_read.values()) == sum(sizes) - sum(sizes[k] for k in held)
            written = sum(sizes) - sum(sizes[k] for k in ran_on) + sum(sizes[k] for k in held)
            assert sum(stats.bytes_written.values()) == written
            assert all(v > 0 for v in stats.bytes_read.values()), "both paths are used"


def test_a_store_the_cache_holds_writes_nothing_until_its_dirty_record_is_evicted(make_tiers):
    tiers, plan = make_tiers(host_cache=2 * 640)
    size, placement = record_size(plan), (0, 1, 0, 1)
    assert size == 640, "four records of 640 bytes: the cache holds two"
    fields = {k: fields_of(plan.subgroups[k].layout, k + 0.5) for k in range(4)}
    assert store(tiers, 0, fields[0], size, 1, placement) == []
    assert store(tiers, 1, fields[1], size, 1, placement) == []
    (written,) = store(tiers, 2, fields[2], size, 1, placement)  # evicts 0, the least recently used
    assert (written.kind, written.path, written.subgroup, written.nbytes) == ("write", 0, 0, size)
    assert written.start <= written.end
    assert tiers.locations.paths == {0: 0}
    read_back = tiers.fetch(0, 1)
    assert (read_back.read.kind, read_back.read.path, read_back.read.nbytes) == ("read", 0, size)
    assert_same_bits(read_back.fields, fields[0])
    cached = tiers.fetch(2, 1)
    assert cached.read is None and cached.fields is fields[2], "the cache hands back the fields themselves"


def test_a_record_larger_than_the_cache_is_written_at_once_and_a_clean_eviction_writes_nothing(make_tiers):
    tiers, plan = make_tiers(host_cache=640)
    size = record_size(plan)
    (written,) = store(tiers, 3, fields_of(plan.subgroups[3].layout, 3.0), size + 1, 1, (1, 1, 1, 1))
    assert (written.path, written.subgroup) == (1, 3)
    assert store(tiers, 0, fields_of(plan.subgroups[0].layout, 1.0), size, 1, (0, 0, 0, 0)) == []
    tiers.write_back(0, tiers.cache.peek(0), 1)  # written in idle time: now clean
    assert tiers.cache.dirty() == [] and tiers.locations.paths == {3: 1, 0: 1}
    assert store(tiers, 1, fields_of(plan.subgroups[1].layout, 2.0), size, 1, (0, 0, 0, 0)) == [], (
        "evicting a clean record writes nothing"
    )
    assert_same_bits(tiers.fetch(0, 1).fields, fields_of(plan.subgroups[0].layout, 1.0))


def test_a_fetch_names_what_is_missing_or_of_another_step(make_tiers):
    tiers, plan = make_tiers(host_cache=0)
    with pytest.raises(
        jax_mlp.OffloadError,
        match=r"^subgroup 2 has no record of step 1 in the host cache or on any path; restore the last checkpoint",
    ):
        tiers.fetch(2, 1)
    layout = plan.subgroups[2].layout
    tiers.write(2, fields_of(layout, 1.0), 1, 0)
    tiers.write(2, fields_of(layout, 3.0), 3, 0)  # step 3 goes to slot 1, over step 1
    with pytest.raises(jax_mlp.RecordError, match=r"sg000002\.1 holds step 3, expected step 1"):
        tiers.fetch(2, 1)
    with pytest.raises(jax_mlp.RecordError, match=r"record \S+/p0/proc0000/sg000002\.0 is missing or unreadable"):
        tiers.fetch(2, 2)
    assert_same_bits(tiers.fetch(2, 3).fields, fields_of(layout, 3.0))


def test_locations_follow_writes_and_restore_takes_back_a_snapshot(make_tiers):
    tiers, plan = make_tiers(host_cache=0)
    for k in range(4):
        tiers.write(k, fields_of(plan.subgroups[k].layout, k), 1, k % 2)
    before = tiers.locations
    assert before.paths == {0: 0, 1: 1, 2: 0, 3: 1} and before.moved == ()
    tiers.write(0, fields_of(plan.subgroups[0].layout, 9.0), 2, 1)  # subgroup 0 moves to path 1
    assert tiers.locations.paths[0] == 1 and tiers.locations.moved == ((0, 0),)
    tiers.restore(before)
    assert tiers.locations == before
    assert_same_bits(tiers.fetch(0, 1).fields, fields_of(plan.subgroups[0].layout, 0))


def test_a_moved_record_is_dropped_only_once_no_cached_record_is_dirty(make_tiers):
    tiers, plan = make_tiers(host_cache=10 * 640)
    layout_hash, size = plan.layout_hash, record_size(plan)
    tiers.write(0, fields_of(plan.subgroups[0].layout, 1.0), 1, 0)
    tiers.write(0, fields_of(plan.subgroups[0].layout, 2.0), 2, 1)
    store(tiers, 1, fields_of(plan.subgroups[1].layout, 2.0), size, 2, (1, 1, 1, 1))  # dirty in the cache
    tiers.drop_moved()
    assert tiers.paths[0].verified_step(0, 1, layout_hash) == 1, "kept: step 2 is not complete on storage yet"
    tiers.write_back(1, tiers.cache.peek(1), 1)
    tiers.drop_moved()
    assert tiers.paths[0].verified_step(0, 1, layout_hash) is None, "the old record is deleted"
    assert tiers.locations.moved == () and tiers.paths[1].verified_step(0, 0, layout_hash) == 2


def test_a_write_over_a_pinned_record_waits_for_its_reader_and_other_writes_do_not(make_tiers):
    tiers, plan = make_tiers(host_cache=0)
    layout = plan.subgroups[1].layout
    tiers.write(1, fields_of(layout, 2.0), 2, 0)
    pin = tiers.pin(2, timeout=WAIT)
    tiers.write(1, fields_of(layout, 3.0), 3, 0)  # the other slot: no wait
    done = threading.Event()

    def overwrite():
        tiers.write(1, fields_of(layout, 4.0), 4, 0)  # slot 0, where step 2 is pinned
        done.set()

    writer = threading.Thread(target=overwrite)
    writer.start()
    assert not done.wait(0.3), "the write went over a pinned record its reader had not read"
    assert_same_bits(tiers.read_pinned(pin, 1), fields_of(layout, 2.0))
    writer.join(WAIT)
    assert done.is_set() and pin.released
    assert_same_bits(tiers.fetch(1, 4).fields, fields_of(layout, 4.0))


def test_a_pinned_record_not_read_in_time_fails_the_write_naming_the_reader(make_tiers):
    tiers, plan = make_tiers(host_cache=0)
    layout = plan.subgroups[3].layout
    tiers.write(3, fields_of(layout, 2.0), 2, 1)
    pin = tiers.pin(2, timeout=0.2)
    with pytest.raises(
        jax_mlp.OffloadError, match=r"^a reader of step 2 \(a checkpoint save\) has not read subgroup 3 within 0\.2s"
    ):
        tiers.write(3, fields_of(layout, 4.0), 4, 1)
    pin.release()
    tiers.write(3, fields_of(layout, 4.0), 4, 1)
    assert_same_bits(tiers.fetch(3, 4).fields, fields_of(layout, 4.0))


def test_a_pinned_record_that_moved_is_kept_until_read(make_tiers):
    tiers, plan = make_tiers(host_cache=0)
    layout, layout_hash = plan.subgroups[0].layout, plan.layout_hash
    tiers.write(0, fields_of(layout, 2.0), 2, 0)
    pin = tiers.pin(2, timeout=WAIT)
    tiers.write(0, fields_of(layout, 3.0), 3, 1)  # moves to path 1
    tiers.drop_moved()
    assert tiers.paths[0].verified_step(0, 0, layout_hash) == 2, "the reader still needs it"
    assert_same_bits(tiers.read_pinned(pin, 0), fields_of(layout, 2.0))
    tiers.drop_moved()
    assert tiers.paths[0].verified_step(0, 0, layout_hash) is None


def test_a_cached_record_of_the_pinned_step_is_read_from_the_cache(make_tiers):
    tiers, plan = make_tiers(host_cache=10 * 640)
    layout = plan.subgroups[2].layout
    fields = fields_of(layout, 5.0)
    tiers.write_back(2, CacheEntry(fields, record_size(plan), 5, dirty=True), 0)  # on path 0, and not cached
    tiers.cache.put(2, CacheEntry(fields, record_size(plan), 5, dirty=False))
    pin = tiers.pin(5, timeout=WAIT)
    assert pin.keeps(2, 0) and not pin.released
    assert tiers.read_pinned(pin, 2) is fields, "the cached fields themselves, not a read of the record"
    assert pin.released
