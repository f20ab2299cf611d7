"""Multi-path placement against devices that behave like real ones: per-direction throttles, bursts after idle.

The scheduler is driven by a simulated device model (no clock); ``test_devices.py`` runs the library on
real kernel-throttled devices.
"""

from __future__ import annotations

import itertools
import json
import random
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
import pytest

import jax_mlp
from jax_mlp import report
from jax_mlp._src.cli import plots
from jax_mlp._src.schedule.estimates import WINDOW, PathEstimate
from jax_mlp._src.schedule.performance import PathSpeed
from jax_mlp._src.schedule.scheduler import FALLBACK, HOLD, Measured, Scheduler, weighted_interleave
from jax_mlp._src.storage.traffic import Traffic, Usage

MB = 1e6
RECORD = 8 * 2**20
RECORDS = 32  # 256 MiB of state
CACHE = 8 * RECORD  # 64 MiB of host cache


class Device(NamedTuple):
    """A full-duplex device throttled per direction, which after idle time lets ``credit`` seconds of its rate
    through ``speedup`` times faster. A kernel throttle does (on this machine about 0.2 s, almost at once):
    a path given few records looks much faster than it is."""

    read_rate: float
    write_rate: float
    speedup: float = 3.0
    credit: float = 0.2

    def seconds(self, nbytes: float, rate: float) -> float:
        fast = min(nbytes, self.credit * rate)
        return fast / (self.speedup * rate) + (nbytes - fast) / rate


NVME, PFS = Device(300 * MB, 300 * MB), Device(100 * MB, 100 * MB)
KERNEL_NVME, KERNEL_PFS = NVME._replace(speedup=20.0), PFS._replace(speedup=20.0)


class Simulation:
    """Updates of the alternating order with a host cache on simulated devices, fed to a scheduler.

    Reads come from where each record is stored (a moved record from its old path); writes go to the
    scheduler's placement. Records left in the cache are written back in the idle time after the
    update, which the paths' meters count in the next update's usage. The update waits on I/O all
    its time, ``slowdown`` times the slowest path's busy time. Every update follows idle time, so
    the devices let a burst through.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        paths: tuple[Device, ...],
        slowdown: float = 1.0,
        fickle: random.Random | None = None,
    ):
        self.scheduler = scheduler
        self.paths = paths
        self.slowdown = slowdown  # the measured update over the paths' busy time: what the model does not see
        self.fickle = fickle  # if given, each path's burst comes in half the updates, at random
        self.stored = list(scheduler.placement)
        self.idle_writes = [0.0] * len(paths)
        self.step = 0

    def update(self) -> float:
        """Runs one update; returns its I/O time (the slowest path's) and feeds the scheduler."""
        order = self.scheduler.order(self.step)
        cached = CACHE // RECORD
        placement = list(self.scheduler.placement)
        read, write = [0.0] * len(self.paths), [0.0] * len(self.paths)
        for k in order[cached:]:
            read[self.stored[k]] += RECORD
        for k in order[: len(order) - cached]:
            write[placement[k]] += RECORD
        usages, seconds = [], 0.0
        for i, device in enumerate(self.paths):
            if self.fickle is not None and self.fickle.random() < 0.5:
                device = device._replace(speedup=1.0)
            reading = device.seconds(read[i], device.read_rate)
            writing = device.seconds(write[i], device.write_rate)
            idle = self.idle_writes[i] / device.write_rate
            seconds = max(seconds, reading, writing)
            usages.append(
                Usage(
                    int(read[i]),
                    int(write[i] + self.idle_writes[i]),
                    max(reading, writing) + idle,
                    reading,
                    writing + idle,
                )
            )
        self.idle_writes = [0.0] * len(self.paths)
        for k in order[len(order) - cached :]:
            self.idle_writes[placement[k]] += RECORD
        self.stored = placement
        self.scheduler.observe(usages, CACHE, Measured(self.slowdown * seconds, self.slowdown * seconds))
        self.step += 1
        return seconds


def best_update(paths: tuple[Device, ...]) -> tuple[float, float]:
    """The fast path's share and the update time of the best interleaved split, by trying every split."""
    results = []
    for on_fast in range(RECORDS + 1):
        scheduler = Scheduler([RECORD] * RECORDS, [PathSpeed("a", 1, 1), PathSpeed("b", 1, 1)], rebalance=False)
        scheduler.placement = weighted_interleave([RECORD] * RECORDS, [on_fast / RECORDS, 1 - on_fast / RECORDS])
        simulation = Simulation(scheduler, paths)
        times = [simulation.update() for _ in range(7)]
        results.append((sum(times[1:]) / 6, on_fast / RECORDS))
    seconds, share = min(results)
    return share, seconds


@pytest.mark.parametrize(
    "paths",
    [(NVME, PFS), (PFS, NVME), (NVME, NVME), (KERNEL_NVME, KERNEL_PFS)],
    ids=["fast-slow", "slow-fast", "equal", "kernel-like-bursts"],
)
def test_placement_converges_without_moving_back_on_full_duplex_bursty_devices(paths):
    scheduler = Scheduler([RECORD] * RECORDS, [PathSpeed("a", 1e9, 1e9), PathSpeed("b", 1e9, 1e9)])
    simulation = Simulation(scheduler, paths)
    history = [list(scheduler.placement)]
    moves, times = [], []
    for _ in range(20):
        times.append(simulation.update())
        moves.append(scheduler.last_moves)
        history.append(list(scheduler.placement))
    assert sum(moves[8:]) == 0 and not scheduler.fallback, f"still moving: {moves}"
    for k in range(RECORDS):
        visited = [placement[k] for placement in history]
        changes = sum(a != b for a, b in itertools.pairwise(visited))
        assert changes <= 1, f"subgroup {k} moved more than once (back and forth): {visited}"
    best_share, best_seconds = best_update(paths)
    share = scheduler.placement.count(0) / RECORDS
    assert abs(share - best_share) <= 0.1 * max(best_share, 1 - best_share), (share, best_share)
    assert sum(times[-6:]) / 6 <= 1.1 * best_seconds


def test_bursts_that_come_or_not_at_random_are_rarely_taken_for_a_change():
    """A kernel throttle lets a burst through or not as the pauses fall, so a lightly loaded path moves the same load
    in one time or several times it, from one update to the next. Taken for a change of the path, such updates
    moved records, back and forth (the flaky real-device test). Over 40 runs of random bursts, the scheduler that
    took one update 2x off the fit for a change saw 2.9 changes a run and moved a subgroup up to 4 times; a change
    must now be seen twice in a row, outside all the window saw for that load."""
    changes, late_moves = [], []
    for seed in range(40):
        scheduler = Scheduler([RECORD] * RECORDS, [PathSpeed("a", 1e9, 1e9), PathSpeed("b", 1e9, 1e9)])
        simulation = Simulation(scheduler, (KERNEL_NVME, KERNEL_PFS), fickle=random.Random(seed))
        history, moves, changed = [list(scheduler.placement)], [], 0
        for _ in range(24):
            simulation.update()
            moves.append(scheduler.last_moves)
            history.append(list(scheduler.placement))
            changed += any(estimate.changed for estimate in scheduler.estimates)
        assert sum(moves) > 0 and not scheduler.fallback, (seed, moves)
        for k in range(RECORDS):
            visited = [placement[k] for placement in history]
            assert sum(a != b for a, b in itertools.pairwise(visited)) <= 2, f"seed {seed}: subgroup {k}: {visited}"
        changes.append(changed)
        late_moves.append(sum(moves[8:]))
    assert sum(changes) / len(changes) <= 0.5, f"changes seen per run: {changes}"
    assert max(late_moves) <= RECORDS // 4, f"moves after the 8th update, per run: {late_moves}"


def test_paths_slower_together_than_the_fastest_alone_fall_back_to_it():
    scheduler = Scheduler([RECORD] * RECORDS, [PathSpeed("a", 1e9, 1e9), PathSpeed("b", 1e9, 1e9)])
    simulation = Simulation(scheduler, (PFS, NVME), slowdown=3.0)  # 3 times what the paths' busy times explain
    moves = []
    for _ in range(20):
        on_slow = scheduler.placement.count(0)
        simulation.update()
        moves.append(scheduler.last_moves)
        if scheduler.fallback:
            break
    assert scheduler.fallback and scheduler.placement == [1] * RECORDS and scheduler.shares == (0.0, 1.0)
    assert moves[-1] == on_slow > 0, "the subgroups left on the slow path move at once"
    settled = max(i for i, moved in enumerate(moves[:-1]) if moved)
    assert len(moves) - 2 - settled == WINDOW, f"it falls back one window after the moving update: {moves}"
    simulation.update()
    assert scheduler.last_moves == 0 and scheduler.placement == [1] * RECORDS, "and stays there"


# What two kernel-throttled devices (120 and 30 MB/s each way) measured in two runs of test_devices.py's placement
# test (1 MiB records, 32 of them, 8 MiB of host cache): per update, each path's Usage, then the update's Measured.
# The slow path held 2 or 3 records and moved them inside its bursts: its estimate came out several times faster
# than the fast path's. Main's scheduler fell back to it in the first run (29 records moved, 0.22 s updates became
# 0.98 s) and, the model being 20% short of the measured update, to the fast path in the second.
LIGHT_PATH_LOOKS_FAST = [
    ([(0, 12584448, 0.0217, 0.0, 0.0217), (0, 13633152, 0.3526, 0.0, 0.3526)], (0.42, 0.3332)),
    ([(12584448, 17827968, 0.0491, 0.029, 0.0325), (13633152, 15730560, 0.528, 0.2966, 0.5059)], (0.5502, 0.3989)),
    ([(13633152, 15730560, 0.036, 0.0201, 0.0231), (12584448, 17827968, 0.4596, 0.3109, 0.2895)], (0.3882, 0.3556)),
    ([(12584448, 17827968, 0.0323, 0.0212, 0.0219), (13633152, 15730560, 0.414, 0.3646, 0.114)], (0.3384, 0.3158)),
    ([(13633152, 24120192, 0.0442, 0.0226, 0.0319), (12584448, 9438336, 0.4103, 0.4057, 0.1421)], (0.3318, 0.3019)),
    ([(18876672, 28315008, 0.0424, 0.0283, 0.0348), (7340928, 5243520, 0.1975, 0.194, 0.0061)], (0.2224, 0.1891)),
    ([(22022784, 30412416, 0.2144, 0.1144, 0.2038), (4194816, 3146112, 0.0163, 0.0112, 0.0064)], (0.2234, 0.1834)),
    ([(24120192, 30412416, 0.2154, 0.1124, 0.2064), (2097408, 3146112, 0.0102, 0.0047, 0.0058)], (0.2276, 0.1949)),
    ([(24120192, 30412416, 0.2207, 0.1174, 0.2073), (2097408, 3146112, 0.0113, 0.0065, 0.0047)], (0.2282, 0.1899)),
    ([(24120192, 30412416, 0.2109, 0.1138, 0.2023), (2097408, 3146112, 0.0092, 0.0053, 0.004)], (0.2213, 0.1914)),
    ([(24120192, 30412416, 0.2201, 0.1189, 0.2102), (2097408, 3146112, 0.0071, 0.0022, 0.0055)], (0.2199, 0.1885)),
    ([(24120192, 30412416, 0.2223, 0.1193, 0.2116), (2097408, 3146112, 0.0141, 0.0072, 0.0072)], (0.2399, 0.2025)),
    ([(24120192, 30412416, 0.2137, 0.113, 0.1212), (2097408, 3146112, 0.0135, 0.0063, 0.0072)], (0.2302, 0.1984)),
    ([(24120192, 30412416, 0.2172, 0.1143, 0.2082), (2097408, 3146112, 0.0073, 0.0055, 0.0018)], (0.2217, 0.1866)),
    ([(24120192, 30412416, 0.2148, 0.1197, 0.2073), (2097408, 3146112, 0.009, 0.0041, 0.0065)], (0.2248, 0.1972)),
]
MODEL_SHORT_BY_A_FIFTH = [
    ([(0, 12584448, 0.0179, 0.0, 0.0179), (0, 13633152, 0.3576, 0.0, 0.3576)], (0.4197, 0.3455)),
    ([(12584448, 17827968, 0.038, 0.0219, 0.0253), (13633152, 15730560, 0.5282, 0.2931, 0.5095)], (0.5568, 0.4094)),
    ([(13633152, 15730560, 0.0378, 0.0242, 0.0191), (12584448, 17827968, 0.4622, 0.3123, 0.285)], (0.3844, 0.3543)),
    ([(12584448, 17827968, 0.0351, 0.0244, 0.0245), (13633152, 15730560, 0.4153, 0.3661, 0.1164)], (0.3388, 0.3042)),
    ([(13633152, 24120192, 0.0781, 0.0252, 0.0713), (12584448, 9438336, 0.3305, 0.3273, 0.0556)], (0.2749, 0.2375)),
    ([(18876672, 27266304, 0.0485, 0.0327, 0.0354), (7340928, 6292224, 0.1976, 0.1918, 0.0125)], (0.2234, 0.1885)),
    ([(20974080, 31461120, 0.2137, 0.1188, 0.2035), (5243520, 2097408, 0.108, 0.1057, 0.0023)], (0.2204, 0.1912)),
    ([(24120192, 31461120, 0.2161, 0.1203, 0.2042), (2097408, 2097408, 0.0128, 0.0086, 0.0041)], (0.2248, 0.1929)),
    ([(24120192, 31461120, 0.2218, 0.1247, 0.1262), (2097408, 2097408, 0.0081, 0.0049, 0.0055)], (0.2384, 0.2061)),
    ([(24120192, 31461120, 0.2152, 0.1167, 0.206), (2097408, 2097408, 0.0071, 0.004, 0.0032)], (0.226, 0.1918)),
    ([(24120192, 31461120, 0.2123, 0.1184, 0.1989), (2097408, 2097408, 0.0117, 0.0074, 0.0042)], (0.2187, 0.1937)),
    ([(24120192, 31461120, 0.2139, 0.1193, 0.2031), (2097408, 2097408, 0.0045, 0.0021, 0.0025)], (0.2273, 0.1848)),
    ([(24120192, 31461120, 0.2102, 0.1172, 0.2061), (2097408, 2097408, 0.0075, 0.0056, 0.0033)], (0.2153, 0.176)),
    ([(24120192, 32509824, 0.2186, 0.1246, 0.2133), (2097408, 1048704, 0.0135, 0.0121, 0.0015)], (0.2197, 0.1856)),
    ([(25168896, 30412416, 0.2172, 0.117, 0.204), (1048704, 3146112, 0.0093, 0.0022, 0.0093)], (0.23, 0.1926)),
]


def replay(trace: list, slowdown: float = 1.0) -> Scheduler:
    """A scheduler fed a trace of real measurements, its updates' times ``slowdown`` times those measured."""
    scheduler = Scheduler([2**20 + 128] * 32, [PathSpeed("fast", 1e9, 1e9), PathSpeed("slow", 1e9, 1e9)])
    for usages, (seconds, io_wait) in trace:
        scheduler.observe(
            [Usage(*usage) for usage in usages], 8 * 2**20, Measured(slowdown * seconds, slowdown * io_wait)
        )
    return scheduler


@pytest.mark.parametrize("trace", [LIGHT_PATH_LOOKS_FAST, MODEL_SHORT_BY_A_FIFTH], ids=["light-path", "model-short"])
def test_the_fallback_is_for_a_miss_past_the_models_error_and_only_to_a_path_measured_near_the_whole_load(trace):
    scheduler = replay(trace)
    fast, slow = scheduler.speeds
    assert scheduler.placement.count(1) <= 3 and slow.seconds(2**25, 2**25) < fast.seconds(2**25, 2**25), (
        "the slow path, measured inside its bursts, looks the faster for the whole load"
    )
    assert not scheduler.fallback and scheduler.placement.count(1) > 0
    missed = replay(trace, slowdown=FALLBACK + 0.5)  # the updates take far longer than the model can explain
    assert missed.fallback and missed.placement == [0] * 32, (
        "to the path that carried the load, not the one that looked fast"
    )


def test_estimates_fit_rate_and_burst_so_a_lightly_loaded_path_does_not_look_fast():
    estimate = PathEstimate(PathSpeed("p", 1e9, 1e9))
    for _ in range(2):  # 20 bytes let through at once after idle, then 100 bytes/s
        estimate.add(Usage(120, 240, 2.0, 1.0, 2.0))  # full duplex: the union is the longer direction
    assert estimate.speed.read_bandwidth == 120, "one load so far: the plain rate"
    estimate.add(Usage(40, 80, 0.4, 0.2, 0.4))  # looks twice as fast as the device is
    estimate.add(Usage(60, 120, 0.8, 0.4, 0.8))
    estimate.add(Usage(600, 1200, 14.0, 7.0, 14.0))  # one slow update: the medians ignore it
    speed = estimate.speed
    assert speed.read_bandwidth == pytest.approx(100) and speed.read_burst == pytest.approx(20)
    assert speed.write_bandwidth == pytest.approx(100) and speed.write_burst == pytest.approx(40)
    assert speed.serial == 0.0 and speed.seconds(220, 440) == pytest.approx(4.0)
    pipe = PathEstimate(PathSpeed("p", 1e9, 1e9))
    pipe.add(Usage(100, 100, 2.0, 1.0, 1.0))  # one pipe: the directions take turns
    assert pipe.speed.serial == 1.0 and pipe.speed.seconds(100, 100) == 2.0


def test_a_moved_subgroup_stays_put_while_held_against_noise():
    scheduler = Scheduler([RECORD] * RECORDS, [PathSpeed("a", 1e9, 1e9), PathSpeed("b", 1e9, 1e9)])
    fast, slow = Usage(RECORD, RECORD, 0.1, 0.1, 0.1), Usage(RECORD, RECORD, 0.4, 0.4, 0.4)
    for _ in range(3):
        scheduler.observe([fast, slow])
    moved = {k for k, p in enumerate(scheduler.placement) if p == 0} - {k for k in range(RECORDS) if k % 2 == 0}
    assert scheduler.last_moves == len(moved) > 0
    noisy = Usage(RECORD, RECORD, 0.14, 0.14, 0.14)  # 1.4 times off: less than a change
    for _ in range(HOLD - 1):  # the fast path looks much closer to the slow one: the moved ones stay
        scheduler.observe([noisy, slow])
        assert all(scheduler.placement[k] == 0 for k in moved)
        assert not any(estimate.changed for estimate in scheduler.estimates)


def converge(simulation: Simulation, updates: int = 12) -> None:
    for _ in range(updates):
        simulation.update()
    assert simulation.scheduler.last_moves == 0 and not simulation.scheduler.fallback


def follow(simulation: Simulation, paths: tuple[Device, ...], updates: int) -> tuple[list[float], list[list[int]]]:
    """Runs ``updates`` updates on ``paths``; returns their I/O times and each one's placement after it."""
    simulation.paths = paths
    times, placements = [], []
    for _ in range(updates):
        times.append(simulation.update())
        placements.append(list(simulation.scheduler.placement))
    return times, placements


@pytest.mark.parametrize("pair", [(NVME, PFS), (KERNEL_NVME, KERNEL_PFS)], ids=["bursts", "kernel-like-bursts"])
@pytest.mark.parametrize("cut", [4.0, 1.6], ids=["quarter", "to-1/1.6"])
def test_a_cap_cut_mid_run_is_followed_within_3_updates_and_then_settles(pair, cut):
    fast, slow = pair
    scheduler = Scheduler([RECORD] * RECORDS, [PathSpeed("a", 1e9, 1e9), PathSpeed("b", 1e9, 1e9)])
    simulation = Simulation(scheduler, pair)
    converge(simulation)
    cut_pair = (fast, slow._replace(read_rate=slow.read_rate / cut, write_rate=slow.write_rate / cut))
    _, best = best_update(cut_pair)
    times, placements = follow(simulation, cut_pair, 10)
    moved_by = 2  # however large, a change waits for a second update to confirm it
    assert placements[moved_by - 1] == placements[-1], f"the new split is taken after update {moved_by}"
    # the update after the move still reads the moved records from the path they leave
    assert all(t <= 1.15 * best for t in times[moved_by + 1 :]), f"then within 15% of the best split: {times}, {best}"
    settled = [a == b for a, b in itertools.pairwise(placements)]
    assert all(settled[moved_by - 1 :]), "and no more moves"
    for k in range(RECORDS):
        visited = [placement[k] for placement in placements]
        assert sum(a != b for a, b in itertools.pairwise(visited)) <= 1, f"subgroup {k} moved back: {visited}"


@pytest.mark.parametrize("pair", [(NVME, PFS), (KERNEL_NVME, KERNEL_PFS)], ids=["bursts", "kernel-like-bursts"])
def test_contention_on_the_slow_path_is_followed_and_undone_within_3_updates(pair):
    fast, slow = pair
    scheduler = Scheduler([RECORD] * RECORDS, [PathSpeed("a", 1e9, 1e9), PathSpeed("b", 1e9, 1e9)])
    simulation = Simulation(scheduler, pair)
    converge(simulation)
    before = list(scheduler.placement)
    shared = (fast, slow._replace(read_rate=slow.read_rate / 2, write_rate=slow.write_rate / 2))
    _, best_shared = best_update(shared)
    _, best_alone = best_update(pair)
    during, _ = follow(simulation, shared, 6)
    assert scheduler.placement.count(1) < before.count(1), "subgroups left the contended path"
    # a change takes two updates to confirm, and the update after the move reads the moved records from the old path
    assert all(t <= 1.15 * best_shared for t in during[3:]), (during, best_shared)
    after, placements = follow(simulation, pair, 8)
    assert all(t <= 1.15 * best_alone for t in after[3:]), (after, best_alone)
    assert all(a == b for a, b in itertools.pairwise(placements[3:])), "settled again from the 4th update on"
    share = scheduler.placement.count(0) / RECORDS
    assert abs(share - before.count(0) / RECORDS) <= 0.1, "back to about the split before the contention"


def test_traffic_meters_busy_time_per_direction_and_their_union():
    traffic = Traffic(max_inflight=4, lock_file=None, max_read=20e6, max_write=20e6)
    with traffic.metered("read", 2_000_000), traffic.metered("write", 1_000_000):  # the write inside the read
        pass
    usage = traffic.take_usage()
    assert (usage.bytes_read, usage.bytes_written) == (2_000_000, 1_000_000)
    assert usage.read_busy_seconds >= usage.busy_seconds >= usage.write_busy_seconds > 0
    assert traffic.take_usage() == Usage(0, 0, 0.0, 0.0, 0.0)


def test_stats_and_report_show_the_moves_and_each_direction_s_estimate(tmp_path):
    # 2 MiB of adam state in 32 subgroups of 64 KiB: records of 16 KiB on a loaded machine move at the request
    # latency's rate (2-3 MB/s, CI found no move), so the records are large enough that the caps set the rates.
    params = {"w": jnp.full((512, 512), 0.5, jnp.float32)}
    fast = jax_mlp.Path(tmp_path / "fast", max_read="64MB/s", max_write="64MB/s")
    slow = jax_mlp.Path(tmp_path / "slow", max_read="64MB/s", max_write="64MB/s")
    log = tmp_path / "run.jsonl"
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[fast, slow], subgroup_size="64KiB", log_to=log) as tx:
        state = tx.init(params)
        tx.set_caps(1, max_read="2MB/s", max_write="2MB/s")  # the split of equal caps no longer fits
        for step in range(8):
            _, state = tx.update(jax.tree.map(lambda p, s=step: p * 0.1 + s, params), state, params)
        scheduler = tx.scheduler
        lines = [json.loads(text) for text in log.read_text().splitlines()]
    assert sum(line["moves"] for line in lines) == scheduler.moves > 0
    assert not any(line["fallback"] for line in lines)
    estimate = lines[-1]["bandwidth"]
    assert estimate[str(tmp_path / "slow")]["read"] < estimate[str(tmp_path / "fast")]["read"]
    assert estimate[str(tmp_path / "slow")]["write"] <= 2e6 * 1.05
    figure = report.make_figure(report.load_log(log))
    titles = [ax.get_title() for ax in figure.axes]
    assert any(title.startswith(f"{plots.PLACEMENT} ({scheduler.moves} moved in") for title in titles), titles
    assert any(title.startswith(f"{plots.THROUGHPUT} (estimated read/write MB/s: p0 ") for title in titles), titles


@pytest.mark.parametrize("pair", [(NVME, PFS), (KERNEL_NVME, KERNEL_PFS)], ids=["bursts", "kernel-like-bursts"])
def test_a_stall_of_the_whole_machine_moves_nothing(pair):
    scheduler = Scheduler([RECORD] * RECORDS, [PathSpeed("a", 1e9, 1e9), PathSpeed("b", 1e9, 1e9)])
    simulation = Simulation(scheduler, pair)
    converge(simulation)
    placement = list(scheduler.placement)
    stalled = tuple(d._replace(read_rate=d.read_rate / 3, write_rate=d.write_rate / 3) for d in pair)
    for _ in range(2):  # every path 3 times slower for two updates, then back: the machine, not a path
        follow(simulation, stalled, 1)
        follow(simulation, pair, 1)
    assert scheduler.placement == placement and not any(
        estimate.since_change["read"] for estimate in scheduler.estimates
    )


def observe_paths(scheduler: Scheduler, per_record: tuple[float, float], measured: Measured | None = None) -> None:
    """Feeds ``scheduler`` one update in which each path took ``per_record`` seconds per record it holds."""
    counts = [scheduler.placement.count(path) for path in (0, 1)]
    usages = [Usage(n * RECORD, n * RECORD, n * t, n * t, n * t) for n, t in zip(counts, per_record, strict=True)]
    scheduler.observe(usages, measured=measured)


def test_records_go_back_the_way_they_came_only_after_a_path_changes():
    """A throttle makes the path that gave records away look faster than it is (less load, more pauses, more
    bursts): within its noise, that must not send them back, which is how the placement swung on real devices."""
    scheduler = Scheduler([RECORD] * RECORDS, [PathSpeed("a", 1e9, 1e9), PathSpeed("b", 1e9, 1e9)])
    for _ in range(6):
        observe_paths(scheduler, (0.1, 0.4))
    on_slow = scheduler.placement.count(1)
    assert on_slow < RECORDS // 2 and scheduler.moves == RECORDS // 2 - on_slow, "records left the slow path"
    for faster in (1.35, 1.35**2, 1.35**3):  # the slow path looks faster and faster, each time less than a change
        for _ in range(2 * WINDOW):
            observe_paths(scheduler, (0.1, 0.4 / faster))
            assert scheduler.last_moves == 0 and scheduler.placement.count(1) == on_slow
            assert not any(estimate.changed for estimate in scheduler.estimates)
    for _ in range(2):  # a change, the fast path twice as slow twice in a row: now records go back
        observe_paths(scheduler, (0.2, 0.4 / 1.35**3))
    assert scheduler.placement.count(1) > on_slow


def test_moves_that_make_the_measured_update_slower_are_undone_and_nothing_moves_until_a_change():
    """The model predicts a gain from its estimates; if the updates after the move measure slower (the paths get in
    each other's way, or an estimate is biased), the measurement wins."""
    scheduler = Scheduler([RECORD] * RECORDS, [PathSpeed("a", 1e9, 1e9), PathSpeed("b", 1e9, 1e9)])
    start = list(scheduler.placement)
    for _ in range(3):
        observe_paths(scheduler, (0.1, 0.4), Measured(1.0, 1.0))
    assert scheduler.last_moves > 0, "the model moves records off the slow path"
    moves = []
    while scheduler.placement != start and len(moves) < 8:  # the model's moves go on halfway, measured slower
        observe_paths(scheduler, (0.1, 0.4), Measured(1.3, 1.3))
        moves.append(scheduler.last_moves)
    assert scheduler.placement == start, f"the moves are undone, all together: {moves}"
    assert moves[-3:-1] == [0, 0], f"after two settled updates that measured slower: {moves}"
    for _ in range(2 * WINDOW):
        observe_paths(scheduler, (0.1, 0.4), Measured(1.0, 1.0))
        assert scheduler.last_moves == 0 and not scheduler.fallback, "and nothing moves while nothing changes"
    for _ in range(2):  # the slow path changes: twice as slow, twice in a row
        observe_paths(scheduler, (0.1, 0.8), Measured(2.0, 2.0))
    assert scheduler.last_moves > 0


def test_a_switch_between_the_backward_s_order_and_the_split_one_lets_records_go_back():
    """The timed overlap switches between the orders; each makes other loads, and a placement the backward's order
    made (on paths 6x apart, all on the fast one) must not bind the split steps after it."""
    scheduler = Scheduler([RECORD] * RECORDS, [PathSpeed("a", 1e9, 1e9), PathSpeed("b", 1e9, 1e9)])
    for _ in range(6):
        observe_paths(scheduler, (0.1, 0.4))
    on_slow = scheduler.placement.count(1)
    for faster in (1.35, 1.35**2, 1.35**3):  # the slow path looks faster and faster, each time less than a change
        for _ in range(2 * WINDOW):
            observe_paths(scheduler, (0.1, 0.4 / faster))
    assert scheduler.placement.count(1) == on_slow, "nothing goes back the way it came"
    scheduler.follow(range(RECORDS - 1, -1, -1))
    scheduler.follow(None)
    for _ in range(HOLD):
        observe_paths(scheduler, (0.1, 0.4 / 1.35**3))
    assert scheduler.placement.count(1) > on_slow, "the split steps' loads are the paths' again"
