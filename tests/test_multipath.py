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
from jax_mlp._src.schedule.estimates import WINDOW, PathEstimate
from jax_mlp._src.schedule.performance import PathSpeed
from jax_mlp._src.schedule.scheduler import HOLD, Measured, Scheduler, weighted_interleave
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
    simulation = Simulation(scheduler, (PFS, NVME), slowdown=2.0)  # twice what the paths' busy times explain
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
    traffic = Traffic(max_inflight=4, max_read=20e6, max_write=20e6)
    with traffic.transfer("read", 2_000_000), traffic.transfer("write", 1_000_000):  # the write inside the read
        pass
    usage = traffic.take_usage()
    assert (usage.bytes_read, usage.bytes_written) == (2_000_000, 1_000_000)
    assert usage.read_busy_seconds >= usage.busy_seconds >= usage.write_busy_seconds > 0
    assert traffic.take_usage() == Usage(0, 0, 0.0, 0.0, 0.0)


def test_stats_and_report_show_the_moves_and_each_direction_s_estimate(tmp_path):
    params = {"w": jnp.full((512, 256), 0.5, jnp.float32)}  # 1 MiB of adam state: 64 subgroups of 16 KiB
    fast = jax_mlp.Path(tmp_path / "fast", max_read="16MB/s", max_write="16MB/s")
    slow = jax_mlp.Path(tmp_path / "slow", max_read="16MB/s", max_write="16MB/s")
    log = tmp_path / "run.jsonl"
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[fast, slow], subgroup_size="16KiB", log_to=log) as tx:
        state = tx.init(params)
        tx.offloader.set_caps(1, max_read="4MB/s", max_write="4MB/s")  # the split of equal caps no longer fits
        for step in range(8):
            _, state = tx.update(jax.tree.map(lambda p, s=step: p * 0.1 + s, params), state, params)
        scheduler = tx.offloader.scheduler
        lines = [json.loads(text) for text in log.read_text().splitlines()]
    assert sum(line["moves"] for line in lines) == scheduler.moves > 0
    assert not any(line["fallback"] for line in lines)
    estimate = lines[-1]["bandwidth"]
    assert estimate[str(tmp_path / "slow")]["read"] < estimate[str(tmp_path / "fast")]["read"]
    assert estimate[str(tmp_path / "slow")]["write"] <= 4e6 * 1.05
    figure = report.make_figure(report.load_log(log))
    titles = [ax.get_title() for ax in figure.axes]
    assert any(title.startswith(f"{report.PLACEMENT} ({scheduler.moves} moved in") for title in titles), titles
    assert any(title.startswith(f"{report.THROUGHPUT} (estimated read/write MB/s: p0 ") for title in titles), titles


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
