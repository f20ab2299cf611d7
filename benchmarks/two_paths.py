"""The step on two paths of different speeds: placement, the devices' write bound, and the simpler choices.

A model of ``--layers`` tanh layers of ``--width`` (a dict ``l0``, ``l1``, ... as users name them)
trains with bf16 params and fp32 masters (adam's moments and the master in the tiers: 12 bytes a
param), a host cache of ``--cache-fraction`` of that state and otherwise default options, on a fast
path at ``--fast`` and a slow one at each rate of ``--slow`` (each way): real devices throttled by the
kernel (``--devices real``: loop-backed ext4 under a blkio cgroup; needs root) or the library's own
caps (``--devices emulated``). Each pair runs ``--runs`` times on fresh devices, each run training:

* ``fast_alone``: the fast path only, split (grads, then ``tx.update``);
* ``two_paths``: both paths, split;
* ``overlapped``: both paths, ``offload.overlap`` in the loss, ``overlap_mode="always"`` (the mechanism);
* ``timed``: the same with the default ``overlap_mode="timed"``: its first 9 steps are the library's
  trial of both modes (steps 6-8 split), the rest run the mode it chose.

Each update (``stats.seconds``) and each whole step (grads, update, apply) are timed. ``settled`` is
the first update from which no subgroup moves and the placement stays as it is. The figures are
medians over the steps from ``max(settled, 2)`` (``timed``: from step 9): the updates and steps
against the **write bound** (the state over the two devices' write rates, probed in the same run:
every byte of state is written once a step) and against each other (``two_paths`` over
``fast_alone``; ``overlapped`` and ``timed`` over ``two_paths``, step for step).

Writes ``two_paths_<devices>.json`` into ``--out``.

    sudo python benchmarks/two_paths.py --devices real --fast 300MB/s --slow 150MB/s 100MB/s 50MB/s --out results
    python benchmarks/two_paths.py --smoke --out /tmp/two_paths        # a few seconds, for tests
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import statistics
import tempfile
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import optax
from common import parse_with_smoke, print_and_save, probe
from tanh_mlp import TRIAL, batch, loss, make_params, timed_steps

import jax_mlp

ROUTES = {
    "fast_alone": {"paths": ("fast",), "overlap": None},
    "two_paths": {"paths": ("fast", "slow"), "overlap": None},
    "overlapped": {"paths": ("fast", "slow"), "overlap": "always"},
    "timed": {"paths": ("fast", "slow"), "overlap": "timed"},
}
"""What each training runs on, and its overlap mode (None: split)."""

SMOKE = {"layers": 2, "width": 256, "slow": ["100MB/s"], "runs": 1, "steps": 3, "devices": "emulated"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", choices=("real", "emulated"), default="emulated")
    parser.add_argument("--fast", default="300MB/s", help="the fast path's rate, each way")
    parser.add_argument("--slow", nargs="+", default=["150MB/s", "100MB/s", "50MB/s"], help="the slow path's rates")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=8, help="the batch")
    parser.add_argument("--cache-fraction", type=float, default=0.25)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="steps per training (timed: 9 more)")
    parser.add_argument("--out", default="results")
    return parse_with_smoke(parser, argv, SMOKE)


@contextlib.contextmanager
def the_pair(args: argparse.Namespace, slow: str, state_bytes: int) -> Iterator[dict[str, jax_mlp.Path]]:
    """The fast and the slow path: kernel-throttled devices, or directories with the library's caps."""
    rates = {"fast": jax_mlp.parse_rate(args.fast), "slow": jax_mlp.parse_rate(slow)}
    if args.devices == "emulated":
        with tempfile.TemporaryDirectory(prefix="jax_mlp_two_paths_") as root:
            yield {name: jax_mlp.Path(os.path.join(root, name), max_read=r, max_write=r) for name, r in rates.items()}
        return
    import devices

    throttles = [devices.Throttle(rate, rate) for rate in rates.values()]
    with devices.throttled_devices(throttles, size=8 * state_bytes) as made:
        devices.join(made)
        yield {name: jax_mlp.Path(device.mount) for name, device in zip(rates, made.devices, strict=True)}


def write_rate(args: argparse.Namespace, path: jax_mlp.Path, state_bytes: int) -> float:
    """The path's write bandwidth: probed (``jax-mlp probe``) on a real device, its cap on an emulated one."""
    if args.devices == "emulated":
        return path.max_write
    return probe(path.location, state_bytes)["write_bandwidth"]


def settled_at(stats: list[jax_mlp.UpdateStats]) -> int:
    """The first update from which no subgroup moves and the placement stays as it is."""
    settled = len(stats) - 1
    while settled > 0 and stats[settled - 1].moves == 0 and stats[settled - 1].placement == stats[-1].placement:
        settled -= 1
    return settled


def train(route: str, pair: dict[str, jax_mlp.Path], root: str, params: dict, args: argparse.Namespace, cache: int):
    """One training on fresh run directories: each update's and step's seconds, and its stats."""
    paths = [
        jax_mlp.Path(os.path.join(pair[name].location, root), **caps(pair[name])) for name in ROUTES[route]["paths"]
    ]
    mode = ROUTES[route]["overlap"]
    offload = jax_mlp.mlp_offload(
        optax.adam(1e-3), paths=paths, host_cache=cache, master_dtype=jnp.float32, overlap_mode=mode or "timed"
    )
    grads_of = jax.jit(jax.grad(lambda p, x: loss(offload.overlap(p) if mode else p, x)))
    x = batch(params, args.rows)
    steps = args.steps + (TRIAL if mode == "timed" else 0)
    with offload:
        step_s, stats = timed_steps(offload, offload, grads_of, params, x, steps)
        state_bytes = offload.plan.state_nbytes
        offload.close(delete=True)
    first = TRIAL if mode == "timed" else max(settled_at(stats), 2)
    return {
        "update_s": [s.seconds for s in stats],
        "step_s": step_s,
        "placement": [dict(s.placement) for s in stats],
        "moves": [s.moves for s in stats],
        "path_fallback": [s.fallback for s in stats],
        "overlap_fallback": [s.overlap_fallback for s in stats],
        "overlapped": [s.overlapped for s in stats],
        "rolled_back": sum(s.rolled_back for s in stats),
        "settled": settled_at(stats),
        "from_step": first,
        "update_median_s": statistics.median(s.seconds for s in stats[first:]),
        "step_median_s": statistics.median(step_s[first:]),
        "state_bytes": state_bytes,
    }


def caps(path: jax_mlp.Path) -> dict:
    """An emulated path's caps, to give a run directory under it."""
    return {"max_read": path.max_read, "max_write": path.max_write}


def run_pair(args: argparse.Namespace, slow: str, params: dict, state_bytes: int, cache: int) -> dict:
    """One run on a fresh pair: every route, then the figures against the write bound and each other."""
    with the_pair(args, slow, state_bytes) as pair:
        rates = {name: write_rate(args, path, state_bytes) for name, path in pair.items()}
        routes = {route: train(route, pair, route, params, args, cache) for route in ROUTES}
    two, alone = routes["two_paths"], routes["fast_alone"]
    bound = two["state_bytes"] / sum(rates.values())
    return {
        "write_rates": rates,
        "write_bound_s": bound,
        "fast_alone_write_bound_s": two["state_bytes"] / rates["fast"],
        "routes": routes,
        "two_paths_update_over_bound": two["update_median_s"] / bound,
        "overlapped_step_over_bound": routes["overlapped"]["step_median_s"] / bound,
        "timed_step_over_bound": routes["timed"]["step_median_s"] / bound,
        "two_paths_over_fast_alone": two["update_median_s"] / alone["update_median_s"],
        "overlapped_over_split_step": routes["overlapped"]["step_median_s"] / two["step_median_s"],
        "timed_over_split_step": routes["timed"]["step_median_s"] / two["step_median_s"],
        "settled": {route: result["settled"] for route, result in routes.items()},
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    params = make_params(args.layers, args.width, jnp.bfloat16)
    state_bytes = 12 * sum(x.size for x in jax.tree.leaves(params))  # adam's two fp32 moments and the fp32 master
    cache = int(args.cache_fraction * state_bytes)
    result = {"devices": args.devices, "fast": args.fast, "layers": args.layers, "width": args.width, "pairs": {}}
    result.update(rows=args.rows, cache_bytes=cache)
    for slow in args.slow:
        runs = [run_pair(args, slow, params, state_bytes, cache) for _ in range(args.runs)]
        result["pairs"][slow] = runs
        for run in runs:
            print(
                f"{args.fast} + {slow}: bound {run['write_bound_s']:.3f} s; two paths' update "
                f"{run['two_paths_update_over_bound']:.2f}x, overlapped step {run['overlapped_step_over_bound']:.2f}x, "
                f"timed {run['timed_step_over_bound']:.2f}x; two/alone {run['two_paths_over_fast_alone']:.2f}, "
                f"overlapped/split {run['overlapped_over_split_step']:.2f}, timed/split "
                f"{run['timed_over_split_step']:.2f}; settled {run['settled']}"
            )
    every = [run for runs in result["pairs"].values() for run in runs]
    for figure in ("two_paths_over_fast_alone", "overlapped_over_split_step", "timed_over_split_step"):
        result[f"worst_{figure}"] = max(run[figure] for run in every)
    print_and_save(result, pathlib.Path(args.out) / f"two_paths_{args.devices}.json")
    return result


if __name__ == "__main__":
    main()
