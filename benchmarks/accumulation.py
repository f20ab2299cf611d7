"""Gradient accumulation on emulated slow tiers: the update's own time with k = 1 and with k = 4.

One path is emulated with read and write caps well below this machine's disk, with a host cache of
half of the adam state. Before every call the script sleeps ``--idle`` seconds, standing in for
a micro-batch's forward and backward. With k = 1 each update has one such gap of idle disk to write
back its cached records and read ahead; with k = 4 it has four, and its micro-steps read further
ahead once the write-back has drained. Both runs move the same bytes per update (checked here); the
figure is the median wall time of the calls that stream the state, k = 4 over k = 1, in one run.

Writes ``accumulation.json`` into ``--out``.

    python benchmarks/accumulation.py --out benchmarks/results/
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state", default="32MiB", help="adam state size (the fp32 params are half of it)")
    parser.add_argument("--subgroup-size", default="2MiB")
    parser.add_argument("--cap", default="100MB/s", help="read and write cap of the emulated path")
    parser.add_argument("--cache-fraction", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=4, help="accumulate_steps of the accumulating run")
    parser.add_argument("--updates", type=int, default=8, help="updates per run; the first is not counted")
    parser.add_argument("--idle", type=float, default=0.05, help="seconds of simulated forward/backward per call")
    parser.add_argument("--dir", default=None, help="where the emulated tier lives (default: a temp dir)")
    parser.add_argument("--out", default="results", help="output folder for the JSON")
    return parser.parse_args(argv)


def make_params(state_bytes: int) -> dict:
    """Params whose adam state (two fp32 moments) is ``state_bytes``, in four leaves of rows."""
    rows = state_bytes // 8 // 1024
    return {f"w{i}": jnp.full((rows // 4, 1024), 0.01 * (i + 1), jnp.float32) for i in range(4)}


def run(args: argparse.Namespace, root: str, params: dict, steps: int) -> dict:
    """``args.updates`` updates with ``accumulate_steps=steps``; times each call that streams the state."""
    state_bytes = jax_mlp.parse_size(args.state)
    cap = jax_mlp.parse_rate(args.cap)
    tx = jax_mlp.mlp_offload(
        optax.adam(1e-3),
        paths=[jax_mlp.Path(f"{root}/k{steps}", max_read=cap, max_write=cap)],
        subgroup_size=args.subgroup_size,
        host_cache=int(args.cache_fraction * state_bytes),
        accumulate_steps=steps,
    )
    state = tx.init(params)
    rows = []
    for call in range(args.updates * steps):
        grads = jax.tree.map(lambda p, c=call: p * 0.1 + c, params)
        jax.block_until_ready(grads)
        time.sleep(args.idle)
        start = time.perf_counter()
        updates, state = tx.update(grads, state, params)
        jax.block_until_ready(updates)
        seconds = time.perf_counter() - start
        if call % steps == steps - 1:
            stats = tx.stats
            rows.append(
                {
                    "seconds": seconds,
                    "write_wait_s": stats.write_wait_s,  # includes the wait for the idle-time write-back
                    "read_wait_s": stats.read_wait_s,
                    "read_ahead": sum(1 for e in stats.events if e.kind == "read" and e.start < 0),
                    "bytes_read": sum(stats.bytes_read.values()),
                    "bytes_written": sum(stats.bytes_written.values()),
                    "cache_hits": stats.cache_hits,
                }
            )
    tx.close(delete=True)
    steady = rows[1:]
    return {
        "accumulate_steps": steps,
        "median_update_s": statistics.median(u["seconds"] for u in steady),
        "median_read_wait_s": statistics.median(u["read_wait_s"] for u in steady),
        "median_write_wait_s": statistics.median(u["write_wait_s"] for u in steady),
        "updates": rows,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="jax_mlp_accumulation_")
    os.makedirs(args.out, exist_ok=True)
    try:
        params = make_params(jax_mlp.parse_size(args.state))
        single, accumulated = run(args, root, params, 1), run(args, root, params, args.steps)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    traffic = [[(u["bytes_read"], u["bytes_written"]) for u in r["updates"][1:]] for r in (single, accumulated)]
    result = {
        "state_bytes": jax_mlp.parse_size(args.state),
        "cap_bytes_per_s": jax_mlp.parse_rate(args.cap),
        "idle_s_per_call": args.idle,
        "single": single,
        "accumulated": accumulated,
        "same_bytes_per_update": traffic[0] == traffic[1],
        "update_time_ratio": accumulated["median_update_s"] / single["median_update_s"],
    }
    with open(os.path.join(args.out, "accumulation.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(
        f"update with k=1: {single['median_update_s']:.3f} s; with k={args.steps}: "
        f"{accumulated['median_update_s']:.3f} s ({result['update_time_ratio']:.2f}x); "
        f"same bytes per update: {result['same_bytes_per_update']}"
    )
    return result


if __name__ == "__main__":
    main()
