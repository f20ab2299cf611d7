"""Placement, rebalancing and order (schedule/), caps and locks on the paths, the probe, the performance model and the
``jax-mlp plan`` and ``probe`` commands. The idle-time I/O between updates is in test_idle.py."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import textwrap
import time

import optax
import pytest
from helpers import assert_same_bits, grads_at, make_params, run_offload, tmpfs, train

import jax_mlp
from jax_mlp._src.cli.ablation import ABLATION
from jax_mlp._src.plan import partition
from jax_mlp._src.schedule import performance as model
from jax_mlp._src.schedule.estimates import MIN_SAMPLES, WINDOW
from jax_mlp._src.schedule.performance import PathSpeed
from jax_mlp._src.schedule.scheduler import Measured, Scheduler, weighted_interleave
from jax_mlp._src.stats import format_bytes
from jax_mlp._src.storage import capacity
from jax_mlp._src.storage.bandwidth import probe
from jax_mlp._src.storage.record import HEADER_SIZE
from jax_mlp._src.storage.traffic import Traffic, Usage

SUBGROUP = "16KiB"


def test_interleaved_placement_follows_the_shares():
    sizes = [1000] * 30
    placement = weighted_interleave(sizes, [2 / 3, 1 / 3])
    assert placement.count(0) == 20 and placement.count(1) == 10
    assert all(placement[i : i + 3].count(1) == 1 for i in range(0, 30, 3)), "slow-path records are spread out"


def test_best_split_makes_paths_finish_together():
    paths = [PathSpeed("nvme", 5e9, 4e9), PathSpeed("pfs", 2e9, 1e9)]
    shares = model.best_split(paths)
    fast, slow = (path.seconds_per_byte * share for path, share in zip(paths, shares, strict=True))
    assert abs(fast - slow) <= 1e-9 * fast and shares[0] > shares[1]
    prediction = model.predict(paths, num_records=100, record_bytes=1e8)
    assert prediction.shares == model.whole_records(shares, 100), "in whole records"
    fast, slow = prediction.path_seconds
    assert abs(fast - slow) <= 1e8 * paths[1].seconds_per_byte, "together, to a record"
    assert model.predict(paths, num_records=100, record_bytes=1e8, shares=(0.5, 0.5)).seconds > prediction.seconds


def test_critical_records_of_each_order():
    assert model.critical_records(10, 3, alternate=True) == (7, 7, 3)
    assert model.critical_records(10, 3, alternate=False) == (10, 7, 3)
    assert model.critical_records(10, 12, alternate=True) == (0, 0, 10)
    # The last 4 writes run on past the update; the next takes those records from memory (held), or reads them.
    assert model.critical_records(10, 3, alternate=True, run_on=4, held=True) == (3, 3, 7)
    assert model.critical_records(10, 3, alternate=True, run_on=4) == (7, 3, 7)
    assert model.critical_records(10, 3, alternate=False, run_on=4, held=True) == (10, 3, 7)
    assert model.critical_records(10, 8, alternate=True, run_on=4, held=True) == (0, 0, 10)


def test_the_loads_the_placement_balances_leave_out_what_runs_on_or_comes_from_memory():
    """Per record, over the two steps of the alternating order: a 2-record cache, the last 3 writes run on and
    their records taken from memory by the next update; with a followed order, the last 3 uncached records'
    writes run on but are read (the next update reads them last, from their paths)."""
    speeds = [PathSpeed("a", 1e8, 1e8)]
    scheduler = Scheduler([100] * 10, speeds, run_on=3, held=True)
    loads = scheduler.loads(200)
    assert sum(loads.read) == sum(loads.write) == 5 * 100  # 10 - 2 cached - 3 run on, each step
    before = Scheduler([100] * 10, speeds).loads(200)
    assert sum(before.read) == sum(before.write) == 8 * 100, "without: all but the 2 cached, each step"
    scheduler.follow(range(9, -1, -1))
    loads = scheduler.loads(200)
    assert [k for k, r in enumerate(loads.read) if r] == [2, 3, 4, 5, 6, 7, 8, 9], "all but the cached 1 and 0"
    assert [k for k, w in enumerate(loads.write) if w] == [5, 6, 7, 8, 9], "and written during it but 4, 3, 2"


def test_the_pipeline_fill_is_a_record_on_a_path_the_shares_draw():
    """Not on the slowest path: with 7 in 8 records on a path 6x faster, a slowest-path fill predicted +75%."""
    fast, slow = PathSpeed("fast", 300e6, 300e6), PathSpeed("slow", 50e6, 50e6)
    one = model.predict([fast, slow], num_records=8, record_bytes=50e6, shares=(0.875, 0.125))
    assert one.fill_seconds == pytest.approx(2 * 50e6 * (0.875 / 300e6 + 0.125 / 50e6))
    alone = model.predict([fast], num_records=8, record_bytes=50e6)
    assert alone.fill_seconds == pytest.approx(2 * 50e6 / 300e6)


def test_the_model_splits_whole_records_and_streams_the_step_s_writes_that_the_idle_time_does_not_hide():
    """On two devices 2x apart (the two-device benchmark's 8 records of 48 MiB, a cache of 2, 4 writes running on,
    a forward and backward of 0.03 s), the update is bound by each step writing every record: 5 records on the fast
    device and 3 on the slow one, not 5.33 and 2.67; the fill is inside that stream (it predicted 1.14 s for 0.95)."""
    assert model.whole_records((2 / 3, 1 / 3), 8) == (0.625, 0.375)
    assert model.whole_records((0.74, 0.26), 8) == (0.75, 0.25) and model.whole_records((0.5, 0.5), 0) == (0.5, 0.5)
    fast, slow = PathSpeed("fast", 308e6, 308e6, serial=0.0), PathSpeed("slow", 161e6, 161e6, serial=0.0)
    record = 48 * 2**20
    one = model.predict(
        [fast, slow],
        num_records=8,
        record_bytes=record,
        cache_bytes=2 * record,
        idle_seconds=0.03,
        prefetch_records=4,
        run_on=4,
    )
    assert one.shares == (0.625, 0.375)
    assert one.seconds == pytest.approx(3 * record / 161e6 - 0.03), "the slow device's 3 records, less the idle time"
    hidden = model.predict(
        [fast, slow], num_records=8, record_bytes=record, cache_bytes=2 * record, prefetch_records=4, run_on=4
    )
    assert hidden.seconds == pytest.approx(max(hidden.path_seconds) + hidden.fill_seconds), "a long forward hides it"


def test_every_record_is_written_once_a_step_during_the_update_or_in_the_idle_time_after():
    for run_on, held, cache in ((3, True, 200), (0, False, 200), (3, True, 1000), (3, False, 0)):
        scheduler = Scheduler([100] * 10, [PathSpeed("a", 1e8, 1e8)], run_on=run_on, held=held)
        loads = scheduler.loads(cache)
        assert [w + i for w, i in zip(loads.write, loads.idle_write, strict=True)] == [100.0] * 10, (run_on, cache)
        scheduler.follow(range(9, -1, -1))
        loads = scheduler.loads(cache)
        assert [w + i for w, i in zip(loads.write, loads.idle_write, strict=True)] == [100.0] * 10, (run_on, cache)


def test_idle_time_writes_that_do_not_fit_between_updates_count_against_their_path():
    """With a long forward and backward the writes after an update are free; with a small batch they are not, and a
    split that balances only the update's own writes leaves the slow path the bound (4 : 4 stayed on paths 2x apart)."""
    fast, slow = PathSpeed("fast", 300e6, 300e6, serial=0.0), PathSpeed("slow", 150e6, 150e6, serial=0.0)
    loads = model.Loads(read=[0.0] * 4, write=[100e6, 0.0, 0.0, 0.0], idle_write=[0.0, 100e6, 100e6, 100e6])
    even, favours_fast = [0, 1, 0, 1], [0, 0, 0, 1]
    assert loads.seconds([fast, slow], even, even) == loads.seconds([fast, slow], favours_fast, favours_fast)
    short = model.Loads(loads.read, loads.write, loads.idle_write, idle_seconds=0.1)
    assert short.seconds([fast, slow], even, even) == pytest.approx(2e8 / 150e6 - 0.1)
    assert short.seconds([fast, slow], favours_fast, favours_fast) == pytest.approx(3e8 / 300e6 - 0.1)
    assert short.shares([fast, slow])[0] == pytest.approx(2 / 3, abs=1e-6), "the whole step's bytes, split 2 : 1"


def test_the_measured_time_between_updates_moves_records_the_update_alone_would_leave():
    """8 records on paths 2x apart, a cache of 2 and 4 writes running on (the two-device benchmark's 4 : 4)."""
    record = 48 * 2**20
    rates = (300e6, 150e6)

    def run(idle: float) -> Scheduler:
        scheduler = Scheduler(
            [record] * 8, [PathSpeed("fast", 1e9, 1e9, 0.0), PathSpeed("slow", 1e9, 1e9, 0.0)], run_on=4, held=True
        )
        for _ in range(MIN_SAMPLES + 1):  # each path reads its 3 uncached records and writes its 4, each way apart
            usages = [
                Usage(3 * record, 4 * record, 4 * record / rate, 3 * record / rate, 4 * record / rate) for rate in rates
            ]
            scheduler.observe(usages, 2 * record, Measured(8 * record / rates[1], 8 * record / rates[1], idle))
        return scheduler

    assert run(math.inf).placement.count(0) == 4, "balanced in the update's own loads: nothing to gain"
    assert run(0.05).idle_seconds == pytest.approx(0.05)
    assert run(0.05).placement.count(0) > 4, "the step's writes on the slow path are the update's bound"


def test_the_first_split_follows_the_rates_of_the_init_s_writes():
    record = 64 * 2**20  # 1.8 s and 5.4 s of writes: the throttle slice each is taken to have let through hardly counts
    equal = [PathSpeed("a", 1e9, 1e9), PathSpeed("b", 1e9, 1e9)]

    def init_writes(rates, held=(8, 8)):
        return [Usage(0, n * record, n * record / r, 0.0, n * record / r) for n, r in zip(held, rates, strict=True)]

    scheduler = Scheduler([record] * 16, equal)
    scheduler.start(init_writes((300e6, 100e6)))
    assert scheduler.placement.count(0) == 12 and scheduler.last_moves == 4, "three quarters on the 3x faster path"
    assert scheduler.shares == pytest.approx((0.75, 0.25), abs=0.01)
    fixed = Scheduler([record] * 16, equal, rebalance=False)
    fixed.start(init_writes((300e6, 100e6)))
    assert fixed.placement.count(0) == 8, "rebalance=False keeps the split it started with"
    nothing = Scheduler([record] * 16, equal)
    nothing.start(init_writes((300e6, 100e6), held=(8, 0)))
    assert nothing.placement.count(0) == 8, "a path that wrote nothing tells nothing"


def test_a_throttle_s_burst_in_the_init_s_writes_is_not_taken_for_its_rate():
    """Measured on kernel-throttled devices of 120 and 30 MB/s: the fast one's 12 MiB of the init passed in one
    burst, 13 ms (970 MB/s), and the split went to 31:1 on it; the updates then read the burst as its rate."""
    record = 2**20
    scheduler = Scheduler([record] * 32, [PathSpeed("fast", 1e9, 1e9), PathSpeed("slow", 1e9, 1e9)])
    scheduler.start([Usage(0, 12 * record, 0.013, 0.0, 0.013), Usage(0, 12 * record, 0.42, 0.0, 0.42)])
    assert 4 <= scheduler.placement.count(1) <= 8, f"about 120:30 counting a slice of each rate: {scheduler.placement}"
    tiny = Scheduler([8320] * 6, [PathSpeed("a", 1e9, 1e9), PathSpeed("b", 1e9, 1e9)])
    tiny.start([Usage(0, 4 * 8320, 0.011, 0.0, 0.011), Usage(0, 2 * 8320, 0.005, 0.0, 0.005)])
    assert tiny.placement.count(0) == 3, "writes all shorter than a slice may all be bursts: they tell no rate"


def test_updates_shorter_than_a_throttle_slice_move_nothing():
    """The linen example's 9 records of 8 KiB on two directories of one disk: the updates' busy times are request
    latency and thread wake-ups, rates apart by chance, waits on I/O that no path alone would shorten. CI saw
    such updates move records and fall back to one path. All of it may have passed in bursts: nothing moves.
    The same rates over records 4x larger, whose busy times outlast a slice, do move them."""

    def run(record: int) -> Scheduler:
        scheduler = Scheduler([record] * 9, [PathSpeed("a", 1e9, 1e9), PathSpeed("b", 1e9, 1e9)], run_on=4, held=True)
        for _ in range(3 * MIN_SAMPLES):
            held = [record * scheduler.placement.count(path) for path in (0, 1)]
            scheduler.observe(
                [Usage(n, n, n / rate, n / rate, n / rate) for n, rate in zip(held, (4e6, 4e5), strict=True)],
                2 * record,
                Measured(0.03, 0.025, 0.01),
            )
        return scheduler

    short = run(8320)  # b's 4 records take 83 ms each way
    assert short.moves == 0 and not short.fallback and short.placement.count(1) == 4, short.placement
    assert run(4 * 8320).moves > 0, "the same rates measured over more than a slice say b is the slower"


def test_the_scheduler_moves_subgroups_to_the_faster_path_after_a_slowdown():
    scheduler = Scheduler([1000] * 40, [PathSpeed("a", 1e8, 1e8), PathSpeed("b", 1e8, 1e8)])
    assert scheduler.shares == (0.5, 0.5)
    rates = (4e4, 1e4)  # path b turned four times slower than a

    def usages():  # each path reads and writes its records, both directions at once
        held = [1000 * scheduler.placement.count(path) for path in (0, 1)]
        return [Usage(n, n, n / rate, n / rate, n / rate) for n, rate in zip(held, rates, strict=True)]

    for _ in range(MIN_SAMPLES):
        scheduler.observe(usages())
    assert (
        scheduler.placement.count(0) > 20
        and scheduler.moves == scheduler.last_moves == scheduler.placement.count(0) - 20
    )
    for _ in range(WINDOW):
        scheduler.observe(usages())
    assert scheduler.placement.count(0) == pytest.approx(32, abs=2), "four fifths on the faster path"
    placement, moves = list(scheduler.placement), scheduler.moves
    for _ in range(2 * WINDOW):
        scheduler.observe(usages())
    assert scheduler.placement == placement and scheduler.moves == moves, "balanced: no move"


def test_ascending_order_never_hits_a_partial_cache_and_alternating_does(paths):
    params = make_params()
    plan = partition.make_plan(params, optax.adam(1e-2), jax_mlp.parse_size(SUBGROUP))
    third = sum(HEADER_SIZE + sg.layout.nbytes for sg in plan.subgroups) // 3
    hits = {}
    for order, path in (("ascending", paths[0]), ("alternate", paths[1])):
        with jax_mlp.mlp_offload(
            optax.adam(1e-2), paths=[path], subgroup_size=SUBGROUP, host_cache=third, order=order, idle_prefetch=False
        ) as tx:
            state = tx.init(params)
            for step in range(3):
                _, state = tx.update(grads_at(params, step), state, params)
            hits[order] = tx.stats.cache_hits
    cached_records = model.critical_records(len(plan.subgroups), 0, alternate=True)[0]
    assert hits["ascending"] == 0
    assert 0 < hits["alternate"] <= cached_records


def test_bits_do_not_depend_on_the_mechanisms_or_on_rebalancing_moves(paths):
    params = make_params()
    inner = optax.adam(1e-2)
    reference = run_offload(inner, params, 6, [paths[0] / "ref"], subgroup_size=SUBGROUP)[0]
    baseline = run_offload(
        inner, params, 6, [paths[1] / "base"], subgroup_size=SUBGROUP, order="ascending", idle_prefetch=False
    )[0]
    assert_same_bits(baseline, reference, "baseline variant")

    fast = jax_mlp.Path(paths[1] / "fast", max_read="16MB/s", max_write="16MB/s")
    slow = jax_mlp.Path(paths[2] / "slow", max_read="8MB/s", max_write="8MB/s")
    with jax_mlp.mlp_offload(
        inner, paths=[fast, slow], subgroup_size=SUBGROUP, host_cache="32KiB", flush="lazy", node_lock=True
    ) as tx:
        current, state = train(tx, params, tx.init(params), range(2))
        tx.set_caps(1, max_read="1MB/s", max_write="1MB/s")
        current, state = train(tx, current, state, range(2, 6))
        scheduler = tx.scheduler
        assert scheduler.moves > 0 and scheduler.shares[0] > 0.75
        tx.flush()
        stored = [
            {int(name[2:8]) for name in os.listdir(root / "proc0000") if name.startswith("sg")}
            for root in (paths[1] / "fast", paths[2] / "slow")
        ]
        assert not stored[0] & stored[1], "old records are removed"
        assert stored[0] | stored[1] == set(range(len(scheduler.placement)))
        assert len(stored[0]) > 0.7 * len(scheduler.placement), "most records moved to the fast path"
    assert_same_bits(current, reference, "rebalanced")


def test_caps_bound_throughput_from_above():
    traffic = Traffic(max_inflight=4, lock_file=None, max_read=20e6, max_write=10e6)
    start = time.monotonic()
    for kind, nbytes in (("read", 2_000_000), ("write", 1_000_000), ("read", 2_000_000)):
        with traffic.metered(kind, nbytes):
            pass
    elapsed = time.monotonic() - start
    assert elapsed >= 0.3 * 0.98, "4 MB at 20 MB/s plus 1 MB at 10 MB/s take 0.3 s at least"
    usage = traffic.take_usage()
    assert (usage.bytes_read, usage.bytes_written) == (4_000_000, 1_000_000)
    assert usage.busy_seconds >= 0.3 * 0.98


def test_in_process_transfers_in_flight_are_limited(tmp_path):
    traffic = Traffic(max_inflight=2, lock_file=None, max_read=50e6, max_write=50e6)
    import concurrent.futures

    held = []  # (start, end) of each transfer's time inside the path's traffic control

    def transfer(_):
        with traffic.metered("read", 500_000):
            start = time.monotonic()
            time.sleep(0.005)
            held.append((start, time.monotonic()))

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(transfer, range(18)))
    events = sorted([(s, 1) for s, _ in held] + [(e, -1) for _, e in held])
    active = peak = 0
    for _, delta in events:
        active += delta
        peak = max(peak, active)
    assert peak == 2


def test_probe_measures_through_the_tier_code_and_respects_caps(tmp_path):
    capped = jax_mlp.Path(tmp_path / "capped", max_read="30MB/s", max_write="15MB/s")
    result = probe(capped, total_bytes=4 * 1024**2, record_bytes=1024**2)
    assert 0 < result.read_bandwidth <= 30e6 * 1.05
    assert 0 < result.write_bandwidth <= 15e6 * 1.05
    assert not (tmp_path / "capped" / ".jax_mlp_probe").exists()


LOCK_CHILD = textwrap.dedent(
    """
    import contextlib, json, sys, time
    import jax
    jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
    import optax, jax.numpy as jnp, jax_mlp
    import jax_mlp._src.storage.paths as storage_paths
    # Each record's read or write, timed inside the path's traffic control (so inside the node lock) on the
    # clock all processes share: the stats' events also time the wait for the lock, so they overlap.
    held, open_path = [], storage_paths.open_path

    def open_timed(*args, **kwargs):
        path = open_path(*args, **kwargs)
        metered = path.traffic.metered

        @contextlib.contextmanager
        def timed(kind, nbytes):
            with metered(kind, nbytes):
                start = time.monotonic()
                yield
                held.append((start, time.monotonic()))

        path.traffic.metered = timed
        return path

    storage_paths.open_path = open_timed
    params = {"w": jnp.ones((512, 256), jnp.float32) * (1 + jax.process_index())}
    tx = jax_mlp.mlp_offload(optax.adam(1e-3), paths=[sys.argv[3]], subgroup_size="64KiB",
                             node_lock=sys.argv[4], write_depth=3, prefetch_depth=3)
    state = tx.init(params)
    for step in range(3):
        _, state = tx.update(jax.tree.map(lambda p: p * 0.1 + step, params), state, params)
    tx.close()
    print(json.dumps(held))
    """
)


def test_the_node_lock_makes_path_access_exclusive_across_processes(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                LOCK_CHILD,
                f"127.0.0.1:{port}",
                str(i),
                str(tmp_path / "shared"),
                str(tmp_path / "locks"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    outputs = []
    for child in children:
        out, err = child.communicate(timeout=240)
        assert child.returncode == 0, err[-3000:]
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(os.listdir(tmp_path / "shared")) == ["proc0000", "proc0001"]
    first, second = ([tuple(interval) for interval in held] for held in outputs)
    assert len(first) > 10 and len(second) > 10
    overlaps = [(a, b) for a in first for b in second if a[0] < b[1] and b[0] < a[1]]
    assert not overlaps, overlaps[:3]


def test_plan_and_probe_commands(tmp_path, capsys):
    from jax_mlp._src.cli import main as cli

    assert cli.main(["plan", "--params", "70e9", "--paths", "nvme=5GB/s,pfs=2GB/s", "--host-cache", "256GiB"]) == 0
    out = capsys.readouterr().out
    split = model.best_split([PathSpeed("nvme", 5e9, 5e9), PathSpeed("pfs", 2e9, 2e9)])
    assert f"nvme           {split[0]:.1%}" in out and f"pfs            {split[1]:.1%}" in out
    assert all(variant.name in out for variant in ABLATION)

    for codec, per_param in (("bf16", "8 B"), ("int8", "6.03 B")):  # 8 B of adam state, 4 B of fp32 master
        assert cli.main(["plan", "--params", "7e9", "--paths", "nvme=5GB/s", "--master", "--state-codec", codec]) == 0
        assert f"7e+09 params, {per_param} of offloaded state each" in capsys.readouterr().out

    assert cli.main(["probe", str(tmp_path / "a"), "--size", "2MiB", "--record", "1MiB"]) == 0
    assert str(tmp_path / "a") in capsys.readouterr().out

    assert cli.main(["plan", "--params", "1e9", "--paths", "nvme"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("jax-mlp plan: error:") and "NAME=RATE" in error and len(error.splitlines()) == 1


def test_probe_and_plan_print_the_room_each_path_needs_against_its_free_space(tmp_path, capsys):
    from jax_mlp._src.cli import main as cli

    with tmpfs(tmp_path / "small", "4m") as small:
        assert (
            cli.main(
                [
                    "probe",
                    str(small),
                    "--size",
                    "1MiB",
                    "--record",
                    "256KiB",
                    "--state",
                    "3MiB",
                    "--subgroup-size",
                    "256KiB",
                ]
            )
            == 0
        )
        out = capsys.readouterr().out
        records = [HEADER_SIZE + 256 * 1024] * 12  # 3 MiB in subgroups of 256 KiB, all on the one path
        need = capacity.need(records)
        assert need > 4 * 2**20
        row = next(line for line in out.splitlines() if line.startswith(str(small)))
        assert row.split()[-5:] == ["4.0", "MiB", *format_bytes(need).split(), "(short)"], out
        # The same figure in the model, and the free space of a NAME that is a directory here.
        args = ["--params", f"{3 * 2**20 / 8}", "--paths", f"{small}=1GB/s", "--subgroup-size", "256KiB"]
        assert cli.main(["plan", *args]) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(str(small)))
        assert row.split()[-5:] == [*format_bytes(need).split(), "4.0", "MiB", "(short)"], row


def test_stats_carry_bandwidth_estimates_that_respect_the_caps(paths):
    params = make_params()
    capped = jax_mlp.Path(paths[1], max_read="20MB/s", max_write="20MB/s")
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0], capped], subgroup_size=SUBGROUP) as tx:
        state = tx.init(params)
        for step in range(2):
            _, state = tx.update(grads_at(params, step), state, params)
            estimate = tx.stats.bandwidth[str(paths[1])]
            assert 0 < estimate["read"] <= 20e6 * 1.05 and 0 < estimate["write"] <= 20e6 * 1.05
            assert tx.stats.bandwidth[str(paths[0])]["read"] > 0
