"""``storage/cache.py``: ``HostCache``, a bounded LRU of fields that never does I/O; and what an update gets from it
(cache hits, bytes not read) with a cache larger than the state and with a partial one.
"""

from __future__ import annotations

import threading

import optax
from helpers import grads_at, make_params

import jax_mlp
from jax_mlp._src.plan import partition
from jax_mlp._src.storage.cache import CacheEntry, HostCache
from jax_mlp._src.storage.record import HEADER_SIZE

SUBGROUP = "16KiB"


def entry(step=0, nbytes=40, dirty=True):
    return CacheEntry(f"fields at {step}", nbytes, step, dirty)


def test_put_evicts_the_least_recently_used_and_returns_them_dirty_or_clean():
    cache = HostCache(100)
    assert cache.put(0, entry(dirty=True)) == [] and cache.put(1, entry(dirty=False)) == []
    assert cache.get(0).fields == "fields at 0"  # 0 is now the most recently used
    evicted = cache.put(2, entry(step=1))
    assert evicted == [(1, entry(dirty=False))], "the least recently used goes, and says it is clean"
    assert cache.nbytes == 80
    evicted = cache.put(3, entry(step=1, nbytes=100))
    assert [key for key, _ in evicted] == [0, 2], "as many as make room, least recently used first"
    assert [e.dirty for _, e in evicted] == [True, True], "the caller writes the dirty ones"
    assert cache.nbytes == 100 and cache.peek(3) is not None and cache.peek(0) is None


def test_peek_and_holds_do_not_touch_the_order_but_get_does():
    cache = HostCache(120)
    for key in range(3):
        cache.put(key, entry(step=5))
    assert cache.peek(0).step == 5 and cache.holds(0, 5) and not cache.holds(0, 4) and not cache.holds(7, 5)
    assert [key for key, _ in cache.put(3, entry())] == [0], "peek and holds left 0 the least recently used"
    cache.get(1)
    assert [key for key, _ in cache.put(4, entry())] == [2], "get made 1 the most recently used"


def test_putting_a_key_again_replaces_its_entry_without_counting_it_twice():
    cache = HostCache(100)
    cache.put(0, entry(step=0))
    cache.put(1, entry(step=0))
    assert cache.put(0, entry(step=1, nbytes=60)) == [], "its own old entry makes the room"
    assert cache.nbytes == 100 and cache.peek(0).step == 1


def test_fits_is_the_capacity_and_a_zero_capacity_holds_nothing():
    assert HostCache(100).fits(100) and not HostCache(100).fits(101)
    assert not HostCache(0).fits(1)


def test_mark_clean_only_for_the_step_written_and_dirty_lists_the_rest_in_lru_order():
    cache = HostCache(1000)
    for key in (3, 1, 2):
        cache.put(key, entry(step=4))
    cache.mark_clean(1, 3)  # a write of an older step: the entry holds a newer one
    cache.mark_clean(2, 4)
    assert [key for key, _ in cache.dirty()] == [3, 1]
    assert cache.peek(2).dirty is False and cache.peek(2).fields == "fields at 4"


def test_discard_unless_step_drops_every_entry_of_another_step():
    """After a failed update: entries of the unfinished step go, those of the intact step stay."""
    cache = HostCache(1000)
    for key, step in ((0, 6), (1, 7), (2, 6), (3, 7)):
        cache.put(key, entry(step=step, nbytes=10 * (key + 1)))
    cache.discard_unless_step(6)
    assert [cache.peek(key) is not None for key in range(4)] == [True, False, True, False]
    assert cache.nbytes == 10 + 30
    cache.clear()
    assert cache.nbytes == 0 and all(cache.peek(key) is None for key in range(4))


def test_threads_putting_at_once_keep_the_count_of_bytes_and_the_bound():
    cache = HostCache(10 * 64)
    evicted = []

    def put_many(thread):
        for i in range(300):
            evicted.extend(cache.put(1000 * thread + i, entry(nbytes=64)))

    threads = [threading.Thread(target=put_many, args=(t,)) for t in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    held = [cache.peek(key) for key in range(6000)]
    held = [e for e in held if e is not None]
    assert len(held) == 10 and cache.nbytes == 10 * 64
    assert len(evicted) == 6 * 300 - 10, "every entry is either held or handed back, once"


def test_with_a_cache_larger_than_the_state_the_second_update_reads_nothing(paths):
    params = make_params()
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP, host_cache="64MiB") as tx:
        state = tx.init(params)
        for step in range(2):
            _, state = tx.update(grads_at(params, step), state, params)
        assert sum(tx.stats.bytes_read.values()) == 0
        assert tx.stats.cache_hits == len(tx.plan.subgroups)
        tx.flush()


def test_a_partial_cache_is_reused_by_the_alternating_order(paths):
    params = make_params()
    plan = partition.make_plan(params, optax.adam(1e-2), jax_mlp.parse_size(SUBGROUP))
    third = sum(HEADER_SIZE + sg.layout.nbytes for sg in plan.subgroups) // 3
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[1]], subgroup_size=SUBGROUP, host_cache=third) as tx:
        state = tx.init(params)
        for step in range(3):
            _, state = tx.update(grads_at(params, step), state, params)
            assert tx.stats.cache_hits >= 1
            assert tx.stats.cache_hits + tx.stats.cache_misses == len(plan.subgroups)
