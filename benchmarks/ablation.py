"""Ablation of the MLP-Offload mechanisms on emulated tiers, against the performance model.

One fast and one slow path are emulated on this machine's disk with bandwidth caps well below
the raw disk (measured in the same run), with a host cache of about a quarter of the state. The
variants of the performance model (``jax-mlp plan``'s mechanisms), then the full scheduler with the state kept in bf16 and in
int8 (``jax_mlp.quantized_state``), run in one process, interleaved iteration by iteration, so
machine noise hits them alike. Between two updates of a variant the script sleeps ``--idle``
seconds, standing in for forward and backward. A second experiment cuts the slow path's cap to a
quarter mid-run and follows how fast rebalancing brings the update time back to the model.

Each exact-math variant also gets its ideal speedup: the ratio of the baseline's in-update I/O bound
to its own, both the bytes each path moved during the update (from the same run's stats) over the
capped bandwidths; ``full_vs_baseline_of_ideal`` is how much of it full achieves. The compute floor of the model (the update time with all state in
the host cache) is measured for each codec by runners stepped in the same interleaved loop.

Writes ``ablation.json`` and ``ablation.png`` into ``--out``.

    python benchmarks/ablation.py --out results/

With ``--devices real`` the paths are real file systems throttled by the kernel instead
(``devices.py``: loop-backed ext4 under a blkio cgroup, each direction throttled apart, with the
bursts a throttle lets through after idle time), which the library's own caps cannot show. A fast
(``--fast``) and a slow (``--slow``) device, then two ``--equal`` ones, each run ``--runs`` times on
fresh devices: the fast path alone without cache (the baseline), the fast path alone with the
cache, and the full scheduler, all with the library's default options. Each is set against the
model's prediction on those rates (full duplex), with the compute floor measured in the same loop;
a run's figures are the medians of its last 5 updates. ``--contention`` adds a run of the full
scheduler where another process does O_DIRECT writes and reads on the slow device (in the same
cgroup, so it shares the throttle) for the middle third of its updates. Needs root; writes
``ablation_real.json``.

    sudo python benchmarks/ablation.py --devices real --fast 300MB/s --slow 90MB/s --equal 200MB/s \
        --state 256MiB --subgroup-size 8MiB --idle 1 --iterations 14 --runs 5 --contention --out results/

Only the public face is used: the variants and every prediction are those of ``jax-mlp plan --json``
(its ``mechanisms``, given the run's state, caps, cache, idle time and each codec's measured compute
floor as ``--update-compute-s``), the raw disk is ``jax-mlp probe --json``, and the bytes each path
moves come from ``tx.stats`` with the record sizes of ``tx.plan`` (payloads: a record's
64-byte header is left out of the bounds).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import NamedTuple

import devices
import jax
import jax.numpy as jnp
import optax
from common import jax_mlp_json

import jax_mlp


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state", default="64MiB", help="adam state size (the fp32 params are half of it)")
    parser.add_argument("--subgroup-size", default="2MiB")
    parser.add_argument("--fast", default="80MB/s", help="cap of the fast path (node-local NVMe)")
    parser.add_argument("--slow", default="48MB/s", help="cap of the slow path (the PFS)")
    parser.add_argument("--cache-fraction", type=float, default=0.25)
    parser.add_argument("--iterations", type=int, default=7)
    parser.add_argument(
        "--depth", type=int, default=None, help="prefetch and write depth of every variant (default: the library's)"
    )
    parser.add_argument(
        "--devices",
        choices=("caps", "real"),
        default="caps",
        help="emulate the tiers with the library's caps, or make real kernel-throttled devices (root)",
    )
    parser.add_argument("--equal", default="200MB/s", help="rate of both devices of the equal pair (real only)")
    parser.add_argument(
        "--pairs", default="fast+slow,equal", help="real only: which pairs of devices to run, comma-separated"
    )
    parser.add_argument("--runs", type=int, default=1, help="runs of each pair of real devices, each on fresh ones")
    parser.add_argument(
        "--contention",
        action="store_true",
        help="real only: also run the full scheduler with another process loading the slow device mid-run",
    )
    parser.add_argument("--idle", type=float, default=0.4, help="seconds of simulated forward/backward")
    parser.add_argument("--dir", default=None, help="where the emulated tiers live (default: a temp dir)")
    parser.add_argument("--out", default="results", help="output folder for the JSON and PNG")
    return parser.parse_args(argv)


class Row(NamedTuple):
    """One row of the ablation: a variant of the mechanisms, and the codec its state is kept in.

    ``variant`` is one of the ``mechanisms`` of ``jax-mlp plan --json``: its ``name``, and which of
    ``alternate``, ``multipath``, ``node_lock`` and ``balanced`` it has on.
    """

    name: str
    variant: dict
    codec: str = "none"


def rows_of(mechanisms: list[dict]) -> tuple[Row, ...]:
    """Each variant of the model, then the full one with the state in each codec of ``quantized_state``."""
    full = mechanisms[-1]
    codecs = tuple(Row(f"+{codec} state", full, codec) for codec in jax_mlp.quantized.CODECS)
    return tuple(Row(variant["name"], variant) for variant in mechanisms) + codecs


def make_params(state_bytes: int) -> dict:
    """Params whose adam state (two fp32 moments) is ``state_bytes``, in a few leaves of rows."""
    elements = state_bytes // 8
    rows = elements // 1024
    return {f"w{i}": jnp.full((rows // 4, 1024), 0.01 * (i + 1), jnp.float32) for i in range(4)}


def options_for(variant: dict, fast: jax_mlp.Path, slow: jax_mlp.Path, cache: int, depth: int | None) -> dict:
    """mlp_offload options that turn the variant's mechanisms on or off; the depths default to the library's."""
    depths = {} if depth is None else dict(prefetch_depth=depth, write_depth=depth)
    return dict(
        paths=[fast, slow] if variant["multipath"] else [fast],
        host_cache=cache if variant["alternate"] else 0,
        order="alternate" if variant["alternate"] else "ascending",
        placement="bandwidth" if variant["balanced"] else "round_robin",
        rebalance=variant["balanced"],
        idle_prefetch=variant["balanced"],
        node_lock=variant["node_lock"],
        **depths,
    )


class Runner:
    """One variant's optimizer, stepped one update at a time."""

    def __init__(self, name: str, params: dict, subgroup_size: str, codec: str = "none", **options):
        self.name = name
        self.params = params
        inner = optax.adam(1e-3) if codec == "none" else jax_mlp.quantized_state(optax.adam(1e-3), codec)
        self.tx = jax_mlp.mlp_offload(inner, subgroup_size=subgroup_size, **options)
        self.state = self.tx.init(params)
        self.caps = [getattr(path, "max_read", None) for path in options["paths"]]
        self.record_bytes = [sg.layout.nbytes for sg in self.tx.plan.subgroups]  # payloads
        self.times: list[float] = []
        self.stats: list[dict] = []
        self.io_bounds: list[float] = []

    def step(self) -> float:
        grads = jax.tree.map(lambda p: p * 0.1 + len(self.times), self.params)
        jax.block_until_ready(grads)
        start = time.perf_counter()
        updates, self.state = self.tx.update(grads, self.state, self.params)
        jax.block_until_ready(updates)
        seconds = time.perf_counter() - start
        self.times.append(seconds)
        bandwidth = {path: dict(speeds) for path, speeds in self.tx.stats.bandwidth.items()}
        self.stats.append({**self.tx.stats.as_dict(), "bandwidth": bandwidth})
        if all(self.caps):
            self.io_bounds.append(io_bound(in_update_bytes(self.tx.stats, self.record_bytes), self.caps))
        return seconds


def in_update_bytes(stats: jax_mlp.UpdateStats, record_bytes: list[int]) -> list[tuple[float, float]]:
    """Bytes each path read and wrote during the update itself, in the order of the paths.

    Transfers in the idle time before it (write-backs, reads ahead) are left out, and one that
    straddles its start counts for the part inside.
    """
    moved = {path: {"read": 0.0, "write": 0.0} for path in stats.paths}
    for event in stats.events:
        if event.kind in ("read", "write") and event.end > 0:
            inside = (event.end - max(event.start, 0.0)) / (event.end - event.start) if event.end > event.start else 1
            moved[event.path][event.kind] += inside * record_bytes[event.subgroup]
    return [(moved[path]["read"], moved[path]["write"]) for path in stats.paths]


def io_bound(moved: list[tuple[float, float]], caps: list[float]) -> float:
    """The update's I/O bound: the busiest path's bytes read and written over its (read = write) cap."""
    return max((read + written) / cap for (read, written), cap in zip(moved, caps, strict=True))


def raw_bandwidth(directory: str, nbytes: int) -> dict:
    """The uncapped path through the same tier code (``jax-mlp probe``): the disk the caps must stay well below."""
    os.makedirs(directory, exist_ok=True)
    (measured,) = jax_mlp_json("probe", directory, "--size", str(nbytes), "--record", "4MiB")
    return measured


class Tiers(NamedTuple):
    """The emulated tiers from the flags: the two paths' caps (read = write), the state and the host cache."""

    fast_cap: float
    slow_cap: float
    state_bytes: int
    cache: int


def tiers_of(args: argparse.Namespace) -> Tiers:
    """The tiers ``--fast``, ``--slow``, ``--state`` and ``--cache-fraction`` describe."""
    state_bytes = jax_mlp.parse_size(args.state)
    cache = int(args.cache_fraction * state_bytes)
    return Tiers(jax_mlp.parse_rate(args.fast), jax_mlp.parse_rate(args.slow), state_bytes, cache)


def capped_paths(directory: str, tiers: Tiers) -> tuple[jax_mlp.Path, jax_mlp.Path]:
    """The fast and the slow path under ``directory``, each capped at its rate."""
    fast = jax_mlp.Path(f"{directory}/fast", max_read=tiers.fast_cap, max_write=tiers.fast_cap)
    slow = jax_mlp.Path(f"{directory}/slow", max_read=tiers.slow_cap, max_write=tiers.slow_cap)
    return fast, slow


def declared(name: str, read: float, write: float, *, duplex: bool = False) -> str:
    """A path as ``jax-mlp plan --paths`` takes its rates: ``NAME=READ:WRITE``, ``:duplex`` for both at once."""
    return f"{name}={read:.0f}B/s:{write:.0f}B/s" + (":duplex" if duplex else "")


def capped(fast_cap: float, slow_cap: float) -> list[str]:
    """The two capped paths as the model sees them: one pipe each (what the caps emulate)."""
    return [declared("fast", fast_cap, fast_cap), declared("slow", slow_cap, slow_cap)]


def predicted(
    plan: jax_mlp.Plan,
    paths: list[str],
    *,
    cache: int,
    idle: float,
    compute: float,
    codec: str = "none",
    subgroup_size: str | None = None,
    depth: int | None = None,
) -> dict:
    """What ``jax-mlp plan --json`` predicts for the plan's state on ``paths``: its records, each variant's update.

    The model gets the plan's records (their count, and their mean payload as the subgroup size) unless
    ``subgroup_size`` is given: it then cuts the state, times the ``codec``'s stored fraction, into records of
    that size, as ``jax-mlp plan --state-codec`` sizes a run. ``cache`` is the host cache, ``idle`` the seconds
    between updates (the forward and backward), ``compute`` the update's with no storage I/O, ``depth`` the
    prefetch and write depth (default: the library's).
    """
    params = sum(math.prod(leaf.shape) for leaf in plan.leaves)
    records = subgroup_size or str(-(-plan.state_nbytes // len(plan.subgroups)))
    sizing = ["--params", str(params), "--state-bytes-per-param", repr(plan.state_nbytes / params)]
    sizing += ["--subgroup-size", records, "--host-cache", str(cache), "--state-codec", codec]
    sizing += ["--compute-s", repr(idle), "--update-compute-s", repr(compute)]
    if depth is not None:
        sizing += ["--prefetch-depth", str(depth), "--write-depth", str(depth)]
    return jax_mlp_json("plan", "--paths", *paths, *sizing)


class Placement(NamedTuple):
    """The scheduler's placement after an update: each path's share of the records, and the records moved so far."""

    shares: list[float]
    moves: int


def _placement_of(tx: jax_mlp.OffloadTransformation) -> Placement:
    """The one place that reads the scheduler's placement."""
    return Placement(list(tx.scheduler.shares), tx.scheduler.moves)


def floor_runners(args: argparse.Namespace, root: str, params: dict, state_bytes: int) -> dict[str, Runner]:
    """Per codec, a runner with all state in the host cache: no I/O wait, so its update time is the compute floor."""
    return {
        codec: Runner(
            f"floor {codec}",
            params,
            args.subgroup_size,
            codec,
            paths=[f"{root}/floor_{codec}"],
            host_cache=4 * state_bytes,
        )
        for codec in ("none", *jax_mlp.quantized.CODECS)
    }


def row_runners(
    args: argparse.Namespace, root: str, params: dict, tiers: Tiers, rows: tuple[Row, ...]
) -> list[tuple[Row, Runner]]:
    """A runner per row of the ablation, each on its own capped paths."""
    runners = []
    for row in rows:
        tag = row.name.strip("+").replace(" ", "_").replace("/", "_")
        options = options_for(row.variant, *capped_paths(f"{root}/{tag}", tiers), tiers.cache, args.depth)
        runners.append((row, Runner(row.name, params, args.subgroup_size, row.codec, **options)))
    return runners


def step_interleaved(runners: list[Runner], iterations: int, idle: float) -> None:
    """Steps every runner once per iteration, in turn, so machine noise hits them alike."""
    for _ in range(iterations):
        for runner in runners:
            runner.step()
            time.sleep(idle)


def predict_row(args: argparse.Namespace, row: Row, plan: jax_mlp.Plan, tiers: Tiers, compute_seconds: float) -> dict:
    """The model's update of the row's variant on the capped paths: seconds, bytes per path, and the records it
    assumed: the plan's, or for compressed state the exact state times the codec's stored fraction in
    ``--subgroup-size`` records, as ``jax-mlp plan --state-codec`` sizes it."""
    run = dict(cache=tiers.cache, idle=args.idle, compute=compute_seconds, codec=row.codec, depth=args.depth)
    sized = None if row.codec == "none" else args.subgroup_size  # compressed: sized as jax-mlp plan sizes it
    figures = predicted(plan, capped(tiers.fast_cap, tiers.slow_cap), subgroup_size=sized, **run)
    variant = next(variant for variant in figures["mechanisms"] if variant["name"] == row.variant["name"])
    return {**variant, "records": figures["records"], "record_bytes": figures["record_bytes"]}


def _bytes_by_path(stats: dict, kind: str) -> dict:
    """``stats``' per-path counters of ``kind`` (``bytes_read``, ``bytes_written``), keyed by the path."""
    return {k.split("[")[1].rstrip("]"): v for k, v in stats.items() if k.startswith(f"{kind}[")}


def row_result(row: Row, runner: Runner, prediction: dict, compute_seconds: float) -> dict:
    """A row's measurements (its first update left out of the medians) next to the model's prediction."""
    steady = runner.times[1:]
    last = runner.stats[-1]
    return {
        "variant": row.name,
        "codec": row.codec,
        "median_update_s": statistics.median(steady),
        "update_s": runner.times,
        "predicted_s": prediction["seconds"],
        "prediction_error": statistics.median(steady) / prediction["seconds"] - 1,
        "compute_floor_s": compute_seconds,
        "records": len(runner.record_bytes),
        "stored_bytes": sum(runner.record_bytes),
        "predicted_records": prediction["records"],
        "predicted_record_bytes": prediction["record_bytes"],
        "in_update_io_bound_s": statistics.median(runner.io_bounds[1:]),
        "bytes_read": _bytes_by_path(last, "bytes_read"),
        "bytes_written": _bytes_by_path(last, "bytes_written"),
        "predicted_bytes_read": prediction["bytes_read"],
        "predicted_bytes_written": prediction["bytes_written"],
        "cache_hits": last["cache_hits"],
    }


def add_speedups(rows: list[dict]) -> None:
    """Adds each row's speedup over the first (the baseline) and, for exact state, its ideal and the share of it."""
    baseline = rows[0]
    for row in rows:
        row["speedup_vs_baseline"] = baseline["median_update_s"] / row["median_update_s"]
        if row["codec"] == "none":
            row["ideal_speedup"] = baseline["in_update_io_bound_s"] / row["in_update_io_bound_s"]
            row["of_ideal"] = row["speedup_vs_baseline"] / row["ideal_speedup"]


def summary(rows: list[dict], plan: jax_mlp.Plan, tiers: Tiers, compute_seconds: float) -> dict:
    """The ablation's result: the setting, the rows, and the headline speedups of full and of int8 state."""
    full = [row for row in rows if row["codec"] == "none"][-1]  # the model's last variant has every mechanism
    return {
        "state_bytes": tiers.state_bytes,
        "records": len(plan.subgroups),
        "record_bytes": plan.state_nbytes / len(plan.subgroups),
        "cache_bytes": tiers.cache,
        "caps_bytes_per_s": {"fast": tiers.fast_cap, "slow": tiers.slow_cap},
        "compute_floor_s": compute_seconds,
        "rows": rows,
        "speedup_full_vs_baseline": full["speedup_vs_baseline"],
        "ideal_speedup_full_vs_baseline": full["ideal_speedup"],
        "full_vs_baseline_of_ideal": full["of_ideal"],
        "speedup_int8_vs_baseline": next(row for row in rows if row["codec"] == "int8")["speedup_vs_baseline"],
    }


def variants() -> list[dict]:
    """The variants of the performance model, from baseline to full, as ``jax-mlp plan --json`` lists them."""
    return jax_mlp_json("plan", "--params", "1", "--paths", "any=1GB/s")["mechanisms"]  # any run lists them all


def run_ablation(args: argparse.Namespace, root: str, params: dict, mechanisms: list[dict]) -> dict:
    """Steps the compute floors and the rows interleaved, then sets each row against the model's prediction."""
    tiers = tiers_of(args)
    floors = floor_runners(args, root, params, tiers.state_bytes)
    runners = row_runners(args, root, params, tiers, rows_of(mechanisms))
    plan = runners[0][1].tx.plan
    step_interleaved([*floors.values(), *(runner for _, runner in runners)], args.iterations, args.idle)
    compute_seconds = {codec: statistics.median(floor.times[1:]) for codec, floor in floors.items()}
    for floor in floors.values():
        floor.tx.close(delete=True)

    rows = []
    for row, runner in runners:
        prediction = predict_row(args, row, plan, tiers, compute_seconds[row.codec])
        rows.append(row_result(row, runner, prediction, compute_seconds[row.codec]))
        runner.tx.close(delete=True)
    add_speedups(rows)
    return summary(rows, plan, tiers, compute_seconds["none"])


def run_rebalance(args: argparse.Namespace, root: str, params: dict, compute_seconds: float, full: dict) -> dict:
    """Cuts the slow path's cap to a quarter after 4 updates, under the ``full`` variant; returns times against the model."""
    tiers = tiers_of(args)
    fast, slow = capped_paths(f"{root}/rebalance", tiers)
    options = options_for(full, fast, slow, tiers.cache, args.depth)
    runner = Runner("rebalance", params, args.subgroup_size, **options)
    plan = runner.tx.plan
    placements = []
    for iteration in range(10):
        if iteration == 4:
            runner.tx.set_caps(1, max_read=tiers.slow_cap / 4, max_write=tiers.slow_cap / 4)
        runner.step()
        placements.append(_placement_of(runner.tx))
        time.sleep(args.idle)
    run = dict(cache=tiers.cache, idle=args.idle, compute=compute_seconds, depth=args.depth)
    after_cut = predicted(plan, capped(tiers.fast_cap, tiers.slow_cap / 4), **run)
    predicted_after = after_cut["mechanisms"][-1]["seconds"]
    moves = _placement_of(runner.tx).moves
    runner.tx.close(delete=True)
    after = runner.times[4:]
    within = [abs(t / predicted_after - 1) <= 0.15 for t in after]
    recovered_after = next((i + 1 for i in range(len(after)) if all(within[i:])), None)
    return {
        "update_s": runner.times,
        "shares": [placement.shares for placement in placements],
        "predicted_after_cut_s": predicted_after,
        "iterations_to_recover": recovered_after,
        "moves": moves,
    }


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["ablation"]["rows"]
    figure, (bars, line) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["variant"] for r in rows]
    x = range(len(rows))
    bars.bar([i - 0.2 for i in x], [r["median_update_s"] for r in rows], 0.4, label="measured (median)")
    bars.bar([i + 0.2 for i in x], [r["predicted_s"] for r in rows], 0.4, label="model")
    bars.set_xticks(list(x), names, rotation=20)
    bars.set_ylabel("update time (s)")
    ablation = result["ablation"]
    bars.set_title(
        f"full is {ablation['speedup_full_vs_baseline']:.2f}x the baseline "
        f"({ablation['full_vs_baseline_of_ideal']:.0%} of the ideal), +int8 {ablation['speedup_int8_vs_baseline']:.2f}x"
    )
    bars.legend()
    rebalance = result["rebalance"]
    line.plot(range(1, 11), rebalance["update_s"], marker="o", label="measured")
    line.axhline(rebalance["predicted_after_cut_s"], color="grey", linestyle="--", label="model, new caps")
    line.axvline(4.5, color="red", linestyle=":", label="slow cap cut to 1/4")
    line.set_xlabel("update")
    line.set_ylabel("seconds")
    line.set_title("rebalancing after a cap cut")
    line.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


REAL_VARIANTS = {
    "fast path alone, no cache": dict(paths=("fast",), host_cache=0),
    "fast path alone": dict(paths=("fast",)),
    "full": dict(paths=("fast", "slow")),
}
"""The variants run on real devices, all with the library's default options otherwise (``--cache-fraction``
of the state in the host cache unless the variant says)."""

CONTENDER = """
import mmap, os, sys
buffer, path = mmap.mmap(-1, 4 << 20), os.path.join(sys.argv[1], "contender")
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT)
while True:
    for offset in range(0, 64 << 20, 4 << 20):
        os.pwrite(fd, buffer, offset)
    for offset in range(0, 64 << 20, 4 << 20):
        os.preadv(fd, [buffer], offset)
"""
"""Another job on the slow device: O_DIRECT writes and reads of a 64 MiB file, 4 MiB at a time, forever."""


def real_pairs(args: argparse.Namespace) -> dict[str, tuple[devices.Throttle, devices.Throttle]]:
    """The device pairs of ``--devices real``: ``--fast`` and ``--slow``, then two ``--equal`` ones."""
    fast, slow, equal = (jax_mlp.parse_rate(rate) for rate in (args.fast, args.slow, args.equal))
    return {
        "fast+slow": (devices.Throttle(fast, fast), devices.Throttle(slow, slow)),
        "equal": (devices.Throttle(equal, equal), devices.Throttle(equal, equal)),
    }


def real_ideal(
    args: argparse.Namespace, variant: dict, pair: tuple[devices.Throttle, ...], plan: jax_mlp.Plan, floor: float
) -> float:
    """The model's update on the throttled rates, both directions at once (the kernel throttles them apart): the
    full scheduler's prediction on the variant's paths and cache, with the library's default depths."""
    named = dict(zip(("fast", "slow"), pair, strict=True))
    paths = [declared(name, named[name].read_bps, named[name].write_bps, duplex=True) for name in variant["paths"]]
    cache = variant.get("host_cache", tiers_of(args).cache)
    figures = predicted(plan, paths, cache=cache, idle=args.idle, compute=floor)
    return figures["mechanisms"][-1]["seconds"]


@contextlib.contextmanager
def real_runners(
    args: argparse.Namespace, params: dict, tiers: Tiers, pair: tuple, variants: dict
) -> Iterator[tuple[devices.Devices, Runner, dict[str, Runner]]]:
    """Makes the two devices, joins their cgroup, and yields them, a compute floor and a runner per variant."""
    with devices.throttled_devices(pair, size=16 * tiers.state_bytes) as made, contextlib.ExitStack() as runs:
        devices.join(made)
        mounts = dict(zip(("fast", "slow"), (device.mount for device in made.devices), strict=True))
        floor = Runner(  # all state cached and never written back: no I/O beside the variants'
            "floor",
            params,
            args.subgroup_size,
            paths=[f"{mounts['fast']}/floor"],
            host_cache=4 * tiers.state_bytes,
            flush="lazy",
        )
        runs.callback(floor.tx.close, delete=True)
        runners = {}
        for index, (name, variant) in enumerate(variants.items()):
            options = {"host_cache": tiers.cache, **{key: value for key, value in variant.items() if key != "paths"}}
            paths = [f"{mounts[path]}/{index}" for path in variant["paths"]]
            runners[name] = Runner(name, params, args.subgroup_size, paths=paths, **options)
            runs.callback(runners[name].tx.close, delete=True)
        yield made, floor, runners


def run_real_pair(args: argparse.Namespace, params: dict, tiers: Tiers, pair: tuple[devices.Throttle, ...]) -> dict:
    """One run on a fresh pair of devices: every real variant and a compute floor stepped interleaved."""
    with real_runners(args, params, tiers, pair, REAL_VARIANTS) as (_, floor, runners):
        step_interleaved([floor, *runners.values()], args.iterations, args.idle)
    compute = statistics.median(floor.times[1:])
    plan = floor.tx.plan
    rows = {name: real_row(args, runner, REAL_VARIANTS[name], pair, plan, compute) for name, runner in runners.items()}
    baseline, cached, full = (rows[name] for name in REAL_VARIANTS)
    ideal_speedup = baseline["ideal_s"] / full["ideal_s"]
    last = full["update_s"][-5:]
    run = {
        "compute_floor_s": compute,
        "rows": rows,
        "speedup": baseline["last_5_s"] / full["last_5_s"],
        "speedup_from_update_4": baseline["median_update_s"] / full["median_update_s"],
        "ideal_speedup": ideal_speedup,
        "last_5_swing": max(last) / min(last),
        "full_vs_fast_alone_same_cache": cached["last_5_s"] / full["last_5_s"],
        "full_vs_fast_alone_same_cache_from_update_4": cached["median_update_s"] / full["median_update_s"],
    }
    run["of_ideal_speedup"] = run["speedup"] / ideal_speedup
    print_run(run)
    return run


def print_run(run: dict) -> None:
    """One line per run of a pair: each variant's steady update against the model, and the figures of the issue."""
    medians = "  ".join(
        f"{variant} {row['last_5_s']:.3f} s (model {row['model_error']:+.0%})" for variant, row in run["rows"].items()
    )
    print(
        f"  {medians}; speedup {run['speedup']:.2f}x of ideal {run['ideal_speedup']:.2f}x "
        f"({run['of_ideal_speedup']:.0%}; from update 4 {run['speedup_from_update_4']:.2f}x), last 5 swing "
        f"{run['last_5_swing']:.2f}x, vs fast alone same cache {run['full_vs_fast_alone_same_cache']:.2f}x, "
        f"moves {run['rows']['full']['moves']}",
        flush=True,
    )


def real_row(
    args: argparse.Namespace, runner: Runner, variant: dict, pair: tuple, plan: jax_mlp.Plan, compute: float
) -> dict:
    """A real variant's updates (the median of the last 5, and of the 4th on), the model's prediction, and moves.

    The last 5 are the steady state: starting from an equal split, full takes a few updates to converge.
    """
    steady = statistics.median(runner.times[-5:])
    ideal = real_ideal(args, variant, pair, plan, compute)
    return {
        "last_5_s": steady,
        "median_update_s": statistics.median(runner.times[3:]),
        "update_s": runner.times,
        "ideal_s": ideal,
        "model_error": ideal / steady - 1,
        "moves": [stats["moves"] for stats in runner.stats],
        "fallback": runner.stats[-1]["fallback"],
        "bandwidth": runner.stats[-1].get("bandwidth"),
        "estimates": [stats.get("bandwidth") for stats in runner.stats],
        "bytes_read": _bytes_by_path(runner.stats[-1], "bytes_read"),
        "bytes_written": _bytes_by_path(runner.stats[-1], "bytes_written"),
    }


def run_contention(args: argparse.Namespace, params: dict, tiers: Tiers) -> dict:
    """The full scheduler on the fast and slow devices while another process loads the slow one mid-run.

    Updates ``[iterations, 2·iterations)`` run with the contender (in the devices' cgroup, so it
    shares the slow device's throttle); the ones before and after without.
    """
    pair = real_pairs(args)["fast+slow"]
    variants = {"full": REAL_VARIANTS["full"]}
    phases = ("before", "during", "after")
    with real_runners(args, params, tiers, pair, variants) as (made, _, runners):
        full = runners["full"]
        shares = []
        for phase in phases:
            with contextlib.ExitStack() as stack:
                if phase == "during":
                    contender = subprocess.Popen([sys.executable, "-c", CONTENDER, made.devices[1].mount])
                    devices.join(made, contender.pid)  # before its first transfer: Python takes longer to start
                    stack.callback(contender.wait)
                    stack.callback(contender.kill)
                for _ in range(args.iterations):
                    full.step()
                    shares.append(_placement_of(full.tx).shares)
                    time.sleep(args.idle)
    n = args.iterations
    return {
        "throttles_bytes_per_s": [t.read_bps for t in pair],
        "update_s": {phase: full.times[i * n : (i + 1) * n] for i, phase in enumerate(phases)},
        "moves": {phase: [s["moves"] for s in full.stats[i * n : (i + 1) * n]] for i, phase in enumerate(phases)},
        "slow_share": {phase: [sh[1] for sh in shares[i * n : (i + 1) * n]] for i, phase in enumerate(phases)},
        "bandwidth": [s.get("bandwidth") for s in full.stats],
    }


def run_real(args: argparse.Namespace) -> dict:
    """``--devices real``: ``--runs`` runs of every pair of :func:`real_pairs`; prints and writes the result."""
    tiers = tiers_of(args)
    params = make_params(tiers.state_bytes)
    chosen = {name: pair for name, pair in real_pairs(args).items() if name in args.pairs.split(",")}
    result = {
        "state_bytes": tiers.state_bytes,
        "cache_bytes": tiers.cache,
        "subgroup_size": args.subgroup_size,
        "idle_s": args.idle,
        "pairs": {
            name: {
                "throttles_bytes_per_s": [t.read_bps for t in pair],
                "runs": [],
            }
            for name, pair in chosen.items()
        },
    }
    for name, pair in chosen.items():
        print(f"{name} ({pair[0].read_bps / 1e6:.0f} / {pair[1].read_bps / 1e6:.0f} MB/s each way):", flush=True)
        for _ in range(args.runs):
            result["pairs"][name]["runs"].append(run_real_pair(args, params, tiers, pair))
    if args.contention:
        result["contention"] = run_contention(args, params, tiers)
    with open(os.path.join(args.out, "ablation_real.json"), "w") as f:
        json.dump(result, f, indent=2)
    if args.contention:
        contention = result["contention"]
        for phase, times in contention["update_s"].items():
            print(
                f"contention {phase}: updates {[round(t, 2) for t in times]} moves {contention['moves'][phase]} "
                f"slow share {[round(s, 2) for s in contention['slow_share'][phase]]}"
            )
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.devices == "real":
        os.makedirs(args.out, exist_ok=True)
        return run_real(args)
    root = args.dir or tempfile.mkdtemp(prefix="jax_mlp_ablation_")
    os.makedirs(args.out, exist_ok=True)
    try:
        raw = raw_bandwidth(f"{root}/raw", 2 * jax_mlp.parse_size(args.state))
        params = make_params(jax_mlp.parse_size(args.state))
        mechanisms = variants()
        ablation = run_ablation(args, root, params, mechanisms)
        result = {
            "raw_disk_bytes_per_s": {"read": raw["read_bandwidth"], "write": raw["write_bandwidth"]},
            "ablation": ablation,
            "rebalance": run_rebalance(args, root, params, ablation["compute_floor_s"], mechanisms[-1]),
            "idle_s": args.idle,
        }
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    with open(os.path.join(args.out, "ablation.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.join(args.out, "ablation.png"))
    for row in result["ablation"]["rows"]:
        ideal = f"   ideal {row['ideal_speedup']:.2f}x ({row['of_ideal']:.0%})" if "ideal_speedup" in row else ""
        print(
            f"{row['variant']:<22} median {row['median_update_s']:.3f} s   model {row['predicted_s']:.3f} s   "
            f"error {row['prediction_error']:+.1%}   {row['speedup_vs_baseline']:.2f}x{ideal}"
        )
    ablation = result["ablation"]
    print(
        f"full vs baseline: {ablation['speedup_full_vs_baseline']:.2f}x, "
        f"{ablation['full_vs_baseline_of_ideal']:.1%} of the ideal {ablation['ideal_speedup_full_vs_baseline']:.2f}x; "
        f"+int8 state vs baseline: {ablation['speedup_int8_vs_baseline']:.2f}x"
    )
    print(f"raw disk: read {raw['read_bandwidth'] / 1e6:.0f} MB/s, write {raw['write_bandwidth'] / 1e6:.0f} MB/s")
    rebalance = result["rebalance"]
    print(
        f"rebalance: {[round(t, 2) for t in rebalance['update_s']]}; model after cut "
        f"{rebalance['predicted_after_cut_s']:.2f} s; within 15% from update {rebalance['iterations_to_recover']} "
        "after the cut"
    )
    return result


if __name__ == "__main__":
    main()
