"""The step with the update overlapped with the backward pass, against the split step, in one run.

A real model (tanh layers of ``--width``, adam over ``--state`` of fp32 state) trains on one path, as
users write it: the layers a dict ``l0``, ``l1``, ... and ``optax.chain(clip_by_global_norm, mlp_offload(adam))``:
a device throttled by the kernel (``--devices real``: a loop-backed ext4 under a blkio cgroup, each
direction apart; needs root) or the library's own caps (``--devices emulated``). ``D`` is the disk
time of what a step must move (read ``S - C``, write ``S``), both directions at once as far as the
path serialises them: ``max(r, w) + serial * min(r, w)`` (docs/scheduling.md) at the path's speed,
measured in the same run by ``jax-mlp probe --json`` on a real device, the caps themselves (one pipe,
what they emulate) on an emulated one. The batch is sized so the forward and backward take ``F`` of
about ``--factors`` × ``D``. For each factor and each of ``--runs`` runs, the same steps run split
(grads, then ``tx.update``) and overlapped (``offload.overlap`` in the loss), one after the other.
The overlapped run takes the default ``overlap_mode="timed"``: its first 9 steps are the library's
trial of both modes (steps 2-4 overlapped, 6-8 split, timed), the rest run the mode it chose. The
figures are each run's median step (split: all but the first; overlapped: the trial's overlapped
steps; chosen: the steps after the trial), against ``max(F, D)`` plus the in-memory update's compute
(``optax.adam`` jitted on the same params), and against the performance model's prediction
(``jax-mlp plan --json``'s ``step``, given the path's speed, the plan's records, the cache, ``F`` and
that compute). The peak RSS of both is sampled in the same run. Default options otherwise (host cache
``--cache-fraction`` of the state). Only the public face is used.

Writes ``overlap_<devices>_<layers>x<width>.json`` into ``--out``.

    sudo python benchmarks/overlap.py --devices real --out benchmarks/results
    python benchmarks/overlap.py --devices emulated --out benchmarks/results
    python benchmarks/overlap.py --smoke --out /tmp/overlap        # a few seconds, for tests
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import statistics
import tempfile
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import optax
from common import RECORD_HEADER, jax_mlp_json, parse_with_smoke, print_and_save, probe
from tanh_mlp import TRIAL, PeakRss, batch, forward_backward_seconds, loss, make_params, rows_for, timed_steps

import jax_mlp

CLIP = 1e9
"""The chain's ``clip_by_global_norm``: far above these grads' norm."""
SMOKE = {"state": "8MiB", "width": 256, "runs": 1, "steps": 3, "factors": [1.0], "devices": "emulated"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", choices=("real", "emulated"), default="emulated")
    parser.add_argument("--rate", default="200MB/s", help="the path's rate, each way")
    parser.add_argument("--state", default="128MiB", help="adam state (two fp32 moments: the params are half)")
    parser.add_argument("--width", type=int, default=1024, help="width of each tanh layer")
    parser.add_argument("--cache-fraction", type=float, default=0.25)
    parser.add_argument("--factors", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="F over D")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--steps", type=int, default=6, help="split steps per run (the first not counted); overlapped: 9 more"
    )
    parser.add_argument("--out", default="results")
    return parse_with_smoke(parser, argv, SMOKE)


@contextlib.contextmanager
def the_path(args: argparse.Namespace) -> Iterator[jax_mlp.Path]:
    """The path under test: a kernel-throttled device, or a directory with the library's caps."""
    rate = jax_mlp.parse_rate(args.rate)
    if args.devices == "emulated":
        with tempfile.TemporaryDirectory(prefix="jax_mlp_overlap_") as root:
            yield jax_mlp.Path(root, max_read=rate, max_write=rate)
        return
    import devices

    size = 8 * jax_mlp.parse_size(args.state)
    with devices.throttled_devices([devices.Throttle(rate, rate)], size) as made:
        devices.join(made)
        yield jax_mlp.Path(made.devices[0].mount)


def speed_of(args: argparse.Namespace, path: jax_mlp.Path, state_bytes: int) -> dict:
    """The path's read and write bandwidth and ``serial``: probed (``jax-mlp probe``), or an emulated path's caps."""
    if args.devices == "emulated":
        rate = jax_mlp.parse_rate(args.rate)
        return {"path": path.location, "read_bandwidth": rate, "write_bandwidth": rate, "serial": 1.0}
    return probe(path.location, state_bytes)


def disk_seconds(speed: dict, read_bytes: float, write_bytes: float) -> float:
    """Seconds the path takes to read and write these bytes at once, as far as its ``serial`` lets it."""
    read, write = read_bytes / speed["read_bandwidth"], write_bytes / speed["write_bandwidth"]
    return max(read, write) + speed["serial"] * min(read, write)


def predicted_steps(speed: dict, params: dict, records: int, cache: int, forward_backward: float, compute: float):
    """The step split and overlapped, as ``jax-mlp plan --json`` predicts it for this run (``step``)."""
    count = sum(x.size for x in jax.tree.leaves(params))
    rates = f"disk={speed['read_bandwidth']:.0f}B/s:{speed['write_bandwidth']:.0f}B/s"
    run = ["--paths", rates + (":duplex" if speed["serial"] < 0.5 else ""), "--params", str(count)]
    run += ["--subgroup-size", str(-(-8 * count // records)), "--host-cache", str(cache)]  # the plan's records
    run += ["--compute-s", repr(forward_backward), "--update-compute-s", repr(compute)]
    step = jax_mlp_json("plan", *run)["step"]
    return {"split": step["split_s"], "overlapped": step["overlapped_s"]}


def layers_for(args: argparse.Namespace) -> int:
    """Layers of ``width`` whose adam state is about ``--state``."""
    return max(2, round(jax_mlp.parse_size(args.state) / 8 / args.width**2))


def train(path: jax_mlp.Path, root: str, params: dict, rows: int, steps: int, cache: int, overlapped: bool) -> dict:
    """``steps`` steps on a fresh run directory; each step's wall time, and the update's stats.

    As users write it: the clipping in the chain (a global norm it never reaches, so no step rolls back).
    """
    location = os.path.join(path.location, root)
    offload = jax_mlp.mlp_offload(
        optax.adam(1e-3),
        paths=[jax_mlp.Path(location, max_read=path.max_read, max_write=path.max_write)],
        host_cache=cache,
    )
    tx = optax.chain(optax.clip_by_global_norm(CLIP), offload)
    grads_of = jax.jit(jax.grad(lambda p, x: loss(offload.overlap(p) if overlapped else p, x)))
    x = batch(params, rows)
    with offload, PeakRss() as rss:
        seconds, stats = timed_steps(tx, offload, grads_of, params, x, steps)
        offload.close(delete=True)
    if overlapped:
        spans = {
            "median_step_s": seconds[2:5],
            "trial_split_step_s": seconds[6:TRIAL],
            "chosen_step_s": seconds[TRIAL:],
        }
    else:
        spans = {"median_step_s": seconds[1:]}
    return {
        "step_s": seconds,
        **{name: statistics.median(span) for name, span in spans.items()},
        "fallback": [s.overlap_fallback for s in stats],
        "overlapped": [s.overlapped for s in stats],
        "rolled_back": sum(s.rolled_back for s in stats),
        "peak_rss": rss.peak,
        "num_records": len(offload.plan.subgroups),
    }


def in_memory_update_seconds(params: dict) -> float:
    """The compute of one plain optax adam update of ``params``, jitted, in memory."""
    tx = optax.adam(1e-3)
    update = jax.jit(tx.update)
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    jax.block_until_ready(update(grads, state, params))
    start = time.perf_counter()
    for _ in range(3):
        jax.block_until_ready(update(grads, state, params))
    return (time.perf_counter() - start) / 3


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    layers = layers_for(args)
    params = make_params(layers, args.width)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    state_bytes = 2 * param_bytes
    # with room for the records' headers, so that a quarter of the state caches a quarter of its records
    cache = int(args.cache_fraction * state_bytes) + RECORD_HEADER * layers
    compute = in_memory_update_seconds(params)
    result = {"devices": args.devices, "rate": args.rate, "layers": layers, "width": args.width}
    result.update(state_bytes=state_bytes, cache_bytes=cache, in_memory_update_s=compute, factors=[])
    with the_path(args) as path:
        speed = speed_of(args, path, state_bytes)
        disk = disk_seconds(speed, state_bytes - cache, state_bytes)  # D: a step's bytes, read S - C and write S
        result.update(speed=speed, disk_s=disk)
        for factor in args.factors:
            rows = rows_for(params, factor * disk)
            runs = []
            for run in range(args.runs):
                forward_backward = forward_backward_seconds(params, rows)
                split = train(path, f"split{run}", params, rows, args.steps, cache, overlapped=False)
                overlapped = train(path, f"overlap{run}", params, rows, TRIAL + args.steps, cache, overlapped=True)
                ideal = max(forward_backward, disk) + compute
                model = predicted_steps(speed, params, split["num_records"], cache, forward_backward, compute)
                runs.append(
                    {
                        "forward_backward_s": forward_backward,
                        "split": split,
                        "overlapped": overlapped,
                        "ideal_s": ideal,
                        "overlapped_over_ideal": overlapped["median_step_s"] / ideal,
                        "chosen_over_ideal": overlapped["chosen_step_s"] / ideal,
                        "chosen_over_split": overlapped["chosen_step_s"] / split["median_step_s"],
                        "split_over_ideal": split["median_step_s"] / ideal,
                        "model_s": model,
                        "model_error": {
                            name: model[name] / route["median_step_s"] - 1
                            for name, route in (("split", split), ("overlapped", overlapped))
                        },
                        "peak_rss_overlapped_over_split": overlapped["peak_rss"] / split["peak_rss"],
                    }
                )
            result["factors"].append({"factor": factor, "rows": rows, "runs": runs})
    result["worst_overlapped_over_ideal"] = max(
        r["overlapped_over_ideal"] for f in result["factors"] for r in f["runs"]
    )
    result["worst_chosen_over_split"] = max(r["chosen_over_split"] for f in result["factors"] for r in f["runs"])
    result["worst_model_error"] = max(
        abs(e) for f in result["factors"] for r in f["runs"] for e in r["model_error"].values()
    )
    print_and_save(result, pathlib.Path(args.out) / f"overlap_{args.devices}_{layers}x{args.width}.json")
    return result


if __name__ == "__main__":
    main()
