"""Ablation of the MLP-Offload mechanisms on emulated tiers, against the performance model.

One fast and one slow path are emulated on this machine's disk with bandwidth caps well below
the raw disk (measured in the same run), with a host cache of about a quarter of the state. The
variants of ``jax_mlp.model.ABLATION`` run in one process, interleaved iteration by iteration, so
machine noise hits them alike. Between two updates of a variant the script sleeps ``--idle``
seconds, standing in for forward and backward. A second experiment cuts the slow path's cap to a
quarter mid-run and follows how fast rebalancing brings the update time back to the model.

Writes ``ablation.json`` and ``ablation.png`` into ``--out``.

    python benchmarks/ablation.py --out results/
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import optax

import jax_mlp
from jax_mlp import model
from jax_mlp.model import PathSpeed
from jax_mlp.storage.probe import probe
from jax_mlp.storage.record import HEADER_SIZE


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state", default="64MiB", help="adam state size (the fp32 params are half of it)")
    parser.add_argument("--subgroup-size", default="2MiB")
    parser.add_argument("--fast", default="80MB/s", help="cap of the fast path (node-local NVMe)")
    parser.add_argument("--slow", default="48MB/s", help="cap of the slow path (the PFS)")
    parser.add_argument("--cache-fraction", type=float, default=0.25)
    parser.add_argument("--iterations", type=int, default=7)
    parser.add_argument("--depth", type=int, default=4, help="prefetch and write depth of every variant")
    parser.add_argument("--idle", type=float, default=0.4, help="seconds of simulated forward/backward")
    parser.add_argument("--dir", default=None, help="where the emulated tiers live (default: a temp dir)")
    parser.add_argument("--out", default="results", help="output folder for the JSON and PNG")
    return parser.parse_args(argv)


def make_params(state_bytes: int) -> dict:
    """Params whose adam state (two fp32 moments) is ``state_bytes``, in a few leaves of rows."""
    elements = state_bytes // 8
    rows = elements // 1024
    return {f"w{i}": jnp.full((rows // 4, 1024), 0.01 * (i + 1), jnp.float32) for i in range(4)}


def options_for(variant: model.Variant, fast: jax_mlp.Path, slow: jax_mlp.Path, cache: int, depth: int) -> dict:
    """mlp_offload options that turn the variant's mechanisms on or off."""
    return dict(
        paths=[fast, slow] if variant.multipath else [fast],
        host_cache=cache if variant.alternate else 0,
        order="alternate" if variant.alternate else "ascending",
        placement="bandwidth" if variant.balanced else "round_robin",
        rebalance=variant.balanced,
        idle_prefetch=variant.balanced,
        node_lock=variant.node_lock,
        prefetch_depth=depth,
        write_depth=depth,
    )


class Runner:
    """One variant's optimizer, stepped one update at a time."""

    def __init__(self, name: str, params: dict, subgroup_size: str, **options):
        self.name = name
        self.params = params
        self.tx = jax_mlp.mlp_offload(optax.adam(1e-3), subgroup_size=subgroup_size, **options)
        self.state = self.tx.init(params)
        self.times: list[float] = []
        self.stats: list[dict] = []

    def step(self) -> float:
        grads = jax.tree.map(lambda p: p * 0.1 + len(self.times), self.params)
        jax.block_until_ready(grads)
        start = time.perf_counter()
        updates, self.state = self.tx.update(grads, self.state, self.params)
        jax.block_until_ready(updates)
        seconds = time.perf_counter() - start
        self.times.append(seconds)
        self.stats.append(self.tx.stats.as_dict())
        return seconds


def raw_bandwidth(directory: str, nbytes: int) -> PathSpeed:
    """The uncapped path through the same tier code: the disk the caps must stay well below."""
    os.makedirs(directory, exist_ok=True)
    return probe(jax_mlp.Path(directory), total_bytes=nbytes, record_bytes=4 * 1024**2).speed


def run_ablation(args: argparse.Namespace, root: str, params: dict) -> dict:
    fast_cap, slow_cap = jax_mlp.parse_rate(args.fast), jax_mlp.parse_rate(args.slow)
    state_bytes = jax_mlp.parse_size(args.state)
    cache = int(args.cache_fraction * state_bytes)

    floor = Runner("floor", params, args.subgroup_size, paths=[f"{root}/floor"], host_cache=4 * state_bytes)
    for _ in range(3):
        floor.step()
    compute_seconds = statistics.median(floor.times[1:])
    floor.tx.close(delete=True)

    runners = []
    for variant in model.ABLATION:
        tag = variant.name.strip("+").replace(" ", "_").replace("/", "_")
        fast = jax_mlp.Path(f"{root}/{tag}/fast", max_read=fast_cap, max_write=fast_cap)
        slow = jax_mlp.Path(f"{root}/{tag}/slow", max_read=slow_cap, max_write=slow_cap)
        runners.append(
            (
                variant,
                Runner(variant.name, params, args.subgroup_size, **options_for(variant, fast, slow, cache, args.depth)),
            )
        )
    plan = runners[0][1].tx.offloader.plan
    record_bytes = statistics.mean(HEADER_SIZE + sg.layout.nbytes for sg in plan.subgroups)
    for _ in range(args.iterations):
        for _, runner in runners:
            runner.step()
            time.sleep(args.idle)

    speeds = [PathSpeed("fast", fast_cap, fast_cap), PathSpeed("slow", slow_cap, slow_cap)]
    rows = []
    for variant, runner in runners:
        prediction = model.predict_variant(
            variant,
            speeds,
            num_records=len(plan.subgroups),
            record_bytes=record_bytes,
            cache_bytes=cache,
            compute_seconds=compute_seconds,
            idle_seconds=args.idle,
        )
        steady = runner.times[1:]
        last = runner.stats[-1]
        rows.append(
            {
                "variant": variant.name,
                "median_update_s": statistics.median(steady),
                "update_s": runner.times,
                "predicted_s": prediction.seconds,
                "prediction_error": statistics.median(steady) / prediction.seconds - 1,
                "bytes_read": {k.split("[")[1].rstrip("]"): v for k, v in last.items() if k.startswith("bytes_read[")},
                "bytes_written": {
                    k.split("[")[1].rstrip("]"): v for k, v in last.items() if k.startswith("bytes_written[")
                },
                "predicted_bytes_read": prediction.bytes_read,
                "predicted_bytes_written": prediction.bytes_written,
                "cache_hits": last["cache_hits"],
            }
        )
        runner.tx.close(delete=True)
    baseline, full = rows[0]["median_update_s"], rows[-1]["median_update_s"]
    return {
        "state_bytes": state_bytes,
        "records": len(plan.subgroups),
        "record_bytes": record_bytes,
        "cache_bytes": cache,
        "caps_bytes_per_s": {"fast": fast_cap, "slow": slow_cap},
        "compute_floor_s": compute_seconds,
        "rows": rows,
        "speedup_full_vs_baseline": baseline / full,
    }


def run_rebalance(args: argparse.Namespace, root: str, params: dict, compute_seconds: float) -> dict:
    """Cuts the slow path's cap to a quarter after 4 updates; returns times against the model."""
    fast_cap, slow_cap = jax_mlp.parse_rate(args.fast), jax_mlp.parse_rate(args.slow)
    state_bytes = jax_mlp.parse_size(args.state)
    cache = int(args.cache_fraction * state_bytes)
    full = model.ABLATION[-1]
    fast = jax_mlp.Path(f"{root}/rebalance/fast", max_read=fast_cap, max_write=fast_cap)
    slow = jax_mlp.Path(f"{root}/rebalance/slow", max_read=slow_cap, max_write=slow_cap)
    runner = Runner("rebalance", params, args.subgroup_size, **options_for(full, fast, slow, cache, args.depth))
    plan = runner.tx.offloader.plan
    record_bytes = statistics.mean(HEADER_SIZE + sg.layout.nbytes for sg in plan.subgroups)
    shares = []
    for iteration in range(10):
        if iteration == 4:
            runner.tx.offloader.set_caps(1, max_read=slow_cap / 4, max_write=slow_cap / 4)
        runner.step()
        shares.append(list(runner.tx.offloader.scheduler.shares))
        time.sleep(args.idle)
    predicted_after = model.predict(
        [PathSpeed("fast", fast_cap, fast_cap), PathSpeed("slow", slow_cap / 4, slow_cap / 4)],
        num_records=len(plan.subgroups),
        record_bytes=record_bytes,
        cache_bytes=cache,
        compute_seconds=compute_seconds,
        idle_seconds=args.idle,
        prefetch_in_idle=True,
    ).seconds
    moves = runner.tx.offloader.scheduler.moves
    runner.tx.close(delete=True)
    after = runner.times[4:]
    within = [abs(t / predicted_after - 1) <= 0.15 for t in after]
    recovered_after = next((i + 1 for i in range(len(after)) if all(within[i:])), None)
    return {
        "update_s": runner.times,
        "shares": shares,
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
    bars.set_title(f"ablation: full is {result['ablation']['speedup_full_vs_baseline']:.2f}x the baseline")
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


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="jax_mlp_ablation_")
    os.makedirs(args.out, exist_ok=True)
    try:
        raw = raw_bandwidth(f"{root}/raw", 2 * jax_mlp.parse_size(args.state))
        params = make_params(jax_mlp.parse_size(args.state))
        ablation = run_ablation(args, root, params)
        result = {
            "raw_disk_bytes_per_s": {"read": raw.read_bandwidth, "write": raw.write_bandwidth},
            "ablation": ablation,
            "rebalance": run_rebalance(args, root, params, ablation["compute_floor_s"]),
            "idle_s": args.idle,
        }
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    with open(os.path.join(args.out, "ablation.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.join(args.out, "ablation.png"))
    for row in result["ablation"]["rows"]:
        print(
            f"{row['variant']:<22} median {row['median_update_s']:.3f} s   model {row['predicted_s']:.3f} s   "
            f"error {row['prediction_error']:+.1%}"
        )
    print(f"full vs baseline: {result['ablation']['speedup_full_vs_baseline']:.2f}x")
    print(f"raw disk: read {raw.read_bandwidth / 1e6:.0f} MB/s, write {raw.write_bandwidth / 1e6:.0f} MB/s")
    rebalance = result["rebalance"]
    print(
        f"rebalance: {[round(t, 2) for t in rebalance['update_s']]}; model after cut "
        f"{rebalance['predicted_after_cut_s']:.2f} s; within 15% from update {rebalance['iterations_to_recover']} "
        "after the cut"
    )
    return result


if __name__ == "__main__":
    main()
