"""``stream/engine.py``: ``Engine.pipeline`` (reads ahead, compute in order, staging, writes behind), its bounds,
errors and timeouts; the idle-time reads ahead and writes behind, and ``ReadAhead``.

The engine is policy-free: it is handed an order and three or four callables. These tests hand it plain functions
that record what ran where and when it was allowed to, on the engine's real threads.
"""

from __future__ import annotations

import threading
import time
import weakref

import pytest

from jax_mlp._src.errors import OffloadError
from jax_mlp._src.stream.engine import Engine, ReadAhead

WAIT = 30.0
"""Seconds a test waits for another thread before it gives up: a bound on a hang, never a measure."""


@pytest.fixture
def make_engine():
    """Makes engines (prefetch_depth, write_depth, io_timeout) and closes them after the test."""
    made = []

    def make(prefetch_depth=2, write_depth=2, io_timeout=WAIT):
        made.append(Engine(prefetch_depth, write_depth, io_timeout))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


class Recorder:
    """Callables for the engine that record, under a lock, what ran on which thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.fetched, self.computed, self.stored = [], [], {}
        self.threads = {"fetch": set(), "compute": set(), "store": set()}

    def _ran(self, kind):
        self.threads[kind].add(threading.current_thread().name)

    def fetch(self, key):
        with self.lock:
            self._ran("fetch")
            self.fetched.append(key)
        return 10 * key

    def compute(self, key, fetched):
        with self.lock:
            self._ran("compute")
            self.computed.append((key, fetched))
        return fetched + 1

    def store(self, key, computed):
        with self.lock:
            self._ran("store")
            self.stored[key] = computed


def test_the_pipeline_computes_in_order_on_the_caller_thread_and_stores_every_result(make_engine):
    order = [3, 1, 4, 0, 2, 6, 5]
    recorder = Recorder()
    timings = make_engine().pipeline(order, recorder.fetch, recorder.compute, recorder.store)
    assert [key for key, _ in recorder.computed] == order
    assert all(fetched == 10 * key for key, fetched in recorder.computed), "compute gets its own key's fetch"
    assert recorder.stored == {key: 10 * key + 1 for key in order}, "every result is stored once it returns"
    assert sorted(recorder.fetched) == sorted(order), "each key is fetched once"
    assert recorder.threads["compute"] == {threading.current_thread().name}
    assert all(name.startswith("jax_mlp-read") for name in recorder.threads["fetch"])
    assert all(name.startswith("jax_mlp-write") for name in recorder.threads["store"])
    assert timings.total >= timings.read_wait + timings.compute + timings.write_wait - 1e-9


@pytest.mark.parametrize("depth", [1, 3])
def test_reads_run_at_most_prefetch_depth_ahead_of_the_compute_and_reach_it(make_engine, depth):
    """While key ``i`` (the i-th of the order) computes, the reads of ``i + 1 .. i + depth`` have been started,
    and no further one: started reads are counted on the reader threads."""
    order = list(range(8))
    started = []
    condition = threading.Condition()

    def fetch(key):
        with condition:
            started.append(key)
            condition.notify_all()
        return key

    ahead = []

    def compute(key, _):
        i = order.index(key)
        expected = min(i + 1 + depth, len(order))
        with condition:
            assert condition.wait_for(lambda: len(started) >= expected, WAIT), "the reads ahead were not started"
            ahead.append(len(started) - (i + 1))
        return key

    make_engine(prefetch_depth=depth).pipeline(order, fetch, compute, lambda key, value: None)
    assert ahead == [min(depth, len(order) - 1 - i) for i in range(len(order))]


@pytest.mark.parametrize("write_depth", [1, 2])
def test_at_most_write_depth_stores_are_in_flight(make_engine, write_depth):
    """Each store waits until the compute of the key ``write_depth`` places later has begun: the engine then
    holds exactly ``write_depth`` unfinished stores, and must wait for the oldest before it goes on."""
    order = list(range(7))
    released = {key: threading.Event() for key in order}
    finished, in_flight = set(), []
    lock = threading.Lock()

    def compute(key, _):
        with lock:
            in_flight.append(key - len(finished))  # stores of keys before this one, not yet finished
        if key >= write_depth:
            released[key - write_depth].set()
        if key == order[-1]:  # nothing computes after the last key: let the tail of the stores go
            for event in released.values():
                event.set()
        return key

    def store(key, _):
        assert released[key].wait(WAIT), f"store {key} was never released"
        with lock:
            finished.add(key)

    make_engine(write_depth=write_depth).pipeline(order, lambda key: key, compute, store)
    assert finished == set(order)
    assert in_flight == [min(key, write_depth) for key in order]


class Failed(Exception):
    """The error a callable of the test raises."""


@pytest.mark.parametrize("where", ["fetch", "compute", "store"])
def test_the_first_error_of_any_thread_reaches_the_caller_and_the_rest_are_settled(make_engine, where):
    """Key 2's callable fails while others are still running: the caller gets that error once nothing else
    runs, and the engine then runs the next pipeline as before. A failed store is seen when the caller waits
    for it, so at most ``write_depth`` more keys compute first."""
    running, ran = set(), []
    lock = threading.Lock()
    slow_started = threading.Event()
    release_slow = threading.Event()

    def step(kind, key, value=None):
        with lock:
            running.add((kind, key))
            ran.append((kind, key))
        try:
            if kind == where and key == 2:
                assert slow_started.wait(WAIT)  # a sibling is mid-call when the error comes
                release_slow.set()
                raise Failed(f"{kind} {key} failed")
            if (kind, key) == ("fetch", 3) or (kind, key) == ("store", 1):
                slow_started.set()
                release_slow.wait(WAIT)
            return key if value is None else value
        finally:
            with lock:
                running.discard((kind, key))

    depth = 2
    engine = make_engine(prefetch_depth=depth, write_depth=depth)
    with pytest.raises(Failed, match=f"{where} 2 failed"):
        engine.pipeline(
            range(8),
            lambda key: step("fetch", key),
            lambda key, value: step("compute", key, value),
            lambda key, value: step("store", key, value),
        )
    assert not running, f"still running after the error reached the caller: {running}"
    last = max(key for kind, key in ran if kind == "compute")
    assert last <= 2 + (depth if where == "store" else 0), f"computed up to key {last} after the failure"
    assert max(key for kind, key in ran if kind == "fetch") <= max(last, 2) + depth, "reads ran further ahead"
    recorder = Recorder()
    engine.pipeline(range(4), recorder.fetch, recorder.compute, recorder.store)
    assert recorder.stored == {key: 10 * key + 1 for key in range(4)}


@pytest.mark.parametrize("where", ["reading", "storing"])
def test_a_hung_read_or_store_times_out_with_io_timeout_and_says_so(make_engine, where):
    hung = threading.Event()
    try:

        def fetch(key):
            if where == "reading" and key == 1:
                hung.wait(WAIT)
            return key

        def store(key, _):
            if where == "storing" and key == 1:
                hung.wait(WAIT)

        engine = make_engine(io_timeout=1.0)
        with pytest.raises(OffloadError) as raised:
            engine.pipeline(range(4), fetch, lambda key, value: value, store, describe="record {} on /nvme".format)
    finally:
        hung.set()
    assert str(raised.value) == (
        f"{where} record 1 on /nvme did not finish within io_timeout=1s; the storage path may be hung: "
        "check its device or mount, or raise io_timeout for a slow path"
    )


def test_writes_behind_are_waited_for_and_their_first_error_is_raised_once(make_engine):
    engine = make_engine()
    stored, release = [], threading.Event()

    def store(key, value):
        assert release.wait(WAIT)
        if key == 1:
            raise Failed("write-back of 1 failed")
        stored.append((key, value))

    for key in range(3):
        engine.write_behind(store, key, f"record {key}")
    assert not engine.background_done()
    release.set()
    with pytest.raises(Failed, match="write-back of 1 failed"):
        engine.wait_background()
    assert engine.background_done()
    assert sorted(stored) == [(0, "record 0"), (2, "record 2")], "the other writes were not dropped"
    assert engine.wait_background() >= 0, "the error is raised once: the next wait finds nothing"


def test_a_hung_write_behind_times_out_naming_the_write_back(make_engine):
    engine = make_engine(io_timeout=0.5)
    hung = threading.Event()
    try:
        engine.write_behind(lambda key, value: hung.wait(WAIT), 0, None)
        with pytest.raises(
            OffloadError, match=r"^writing back cached subgroup 0 did not finish within io_timeout=0\.5s"
        ):
            engine.wait_background()
    finally:
        hung.set()


def test_the_last_run_on_stores_outlive_the_pipeline_and_their_error_names_the_key(make_engine):
    """``run_on=2``: the pipeline returns with the stores of its last two keys still running, as background
    work: waited for, their first error raised once, named by ``describe``, and a hang bounded by io_timeout."""
    engine = make_engine(write_depth=3, io_timeout=0.5)
    stored, release = [], threading.Event()

    def store(key, value):
        if key >= 2:
            assert release.wait(WAIT)
        if key == 3:
            raise Failed("store of 3 failed")
        stored.append(key)

    engine.pipeline(range(4), lambda k: k, lambda k, v: v, store, "key {}".format, run_on=2)
    assert stored == [0, 1] and not engine.background_done(), "the last two stores run on"
    release.set()
    with pytest.raises(Failed, match="store of 3 failed"):
        engine.wait_background()
    assert stored == [0, 1, 2] and engine.wait_background() >= 0

    hung = threading.Event()
    try:
        engine.pipeline([7], lambda k: k, lambda k, v: v, lambda k, v: hung.wait(WAIT), "key {}".format, run_on=1)
        with pytest.raises(OffloadError, match=r"^storing key 7 did not finish within io_timeout=0\.5s"):
            engine.wait_background()
    finally:
        hung.set()


class Computed:
    """A computed value the test can watch die (a weak reference to it goes dead once nothing holds it)."""

    def __init__(self, key):
        self.key = key


def test_stagings_run_in_order_on_the_stager_thread_and_the_store_gets_what_staging_gave(make_engine):
    order = [3, 1, 4, 0, 2, 6, 5]
    staged, threads, stored = [], set(), {}

    def stage(key, computed):
        threads.add(threading.current_thread().name)
        staged.append(key)
        return f"staged {computed.key}"

    make_engine().pipeline(order, lambda k: k, lambda k, _: Computed(k), stored.__setitem__, stage=stage)
    assert staged == order and stored == {key: f"staged {key}" for key in order}
    assert len(threads) == 1 and threads.pop().startswith("jax_mlp-stage")


def test_at_most_two_computed_values_are_held_whatever_the_writes_in_flight(make_engine):
    """Slow stores keep ``write_depth`` writes in flight; the computed values (device arrays, in an update) are
    dropped once staged: when a key computes, only the one before it may still be alive (staging), and no store
    starts while its key's computed value is."""
    write_depth = 3
    alive: weakref.WeakSet = weakref.WeakSet()
    held_at_compute, alive_at_store = [], []
    writing, most_writing = set(), []
    lock = threading.Lock()

    def compute(key, _):
        held_at_compute.append(len(alive))
        computed = Computed(key)
        alive.add(computed)
        return computed

    def store(key, _):
        with lock:
            alive_at_store.append(key in {c.key for c in alive})
            writing.add(key)
            most_writing.append(len(writing))
        time.sleep(0.05)
        with lock:
            writing.discard(key)

    engine = make_engine(write_depth=write_depth)
    engine.pipeline(range(10), lambda k: k, compute, store, stage=lambda key, computed: computed.key)
    assert max(held_at_compute) <= 1, held_at_compute
    assert not any(alive_at_store) and not alive
    assert max(most_writing) == write_depth, "the writes still trail write_depth deep"


def test_a_failed_or_hung_staging_reaches_the_caller_named_by_describe(make_engine):
    engine = make_engine(io_timeout=0.5)

    def failing(key, value):
        if key == 2:
            raise Failed("staging 2 failed")
        return value

    stored = []
    with pytest.raises(Failed, match="staging 2 failed"):
        engine.pipeline(range(6), lambda k: k, lambda k, v: v, lambda k, v: stored.append(k), stage=failing)
    assert set(stored) <= {0, 1}, "nothing from the failed staging on is stored (store 1 may be cancelled)"
    hung = threading.Event()
    try:
        with pytest.raises(OffloadError, match=r"^staging record 1 on /nvme did not finish within io_timeout=0\.5s"):
            engine.pipeline(
                range(4),
                lambda k: k,
                lambda k, v: v,
                lambda k, v: None,
                "record {} on /nvme".format,
                stage=lambda k, v: hung.wait(WAIT) if k == 1 else v,
            )
    finally:
        hung.set()


def test_reads_ahead_are_held_by_key_and_each_is_taken_once(make_engine):
    engine, ahead = make_engine(), ReadAhead()
    for key in (4, 2, 7):
        ahead.add(key, engine.read_ahead(lambda key: f"fields of {key}", key))
    assert ahead.keys() == (4, 2, 7), "in the order they were started"
    taken = ahead.take(2)
    assert engine.result(taken, "reading 2") == "fields of 2"
    assert ahead.take(2) is None and ahead.keys() == (4, 7)
    rest = ahead.take_all()
    assert sorted(future.result(WAIT) for future in rest) == ["fields of 4", "fields of 7"]
    assert ahead.keys() == () and ahead.take_all() == []


def test_settle_cancels_what_has_not_started_and_waits_for_what_has(make_engine):
    engine = make_engine(prefetch_depth=1)
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def slow(key):
        started.set()
        release.wait(0.3)  # still running when settle begins; settle must wait for it
        finished.set()
        return key

    running = engine.read_ahead(slow, 0)
    assert started.wait(WAIT)
    queued = engine.read_ahead(lambda key: key, 1)  # one reader thread: this one waits behind the first
    engine.settle([running, queued])
    assert finished.is_set() and running.done(), "settle returned before the running read finished"
    assert queued.cancelled(), "a read not yet started is cancelled"
