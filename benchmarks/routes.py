"""The two routes of one training step, timed on this machine: the split step and ``update`` inside jit.

- **split**: the loss and gradients under ``jax.jit``, ``tx.update`` called eagerly (the state streams
  through the device), ``optax.apply_updates`` jitted;
- **in_jit**: the whole step under one ``jax.jit``, ``tx.update`` traced inside it (a host callback:
  the update runs on the host CPU);
- **plain**: the same step with adamw held in memory, jitted: the floor neither route can beat.

Same model, data and options for each: an MLP of ``--layers`` square ``--width`` layers, adamw, its
state held whole in the host cache (so storage is off the critical path and the routes alone differ).
The figures are the first step (compilation included) and the median of the steps after it. On CPU
devices both routes run the update on the same CPU; on an accelerator the in-jit route moves every
grad, param and update between the device and the host each step, which this machine cannot show.

Writes ``routes.json`` into ``--out`` when given.

    python benchmarks/routes.py --out benchmarks/results/
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from common import print_and_save

import jax_mlp


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024, help="width of each square layer")
    parser.add_argument("--layers", type=int, default=8, help="number of layers")
    parser.add_argument("--subgroup-size", default="8MiB")
    parser.add_argument("--steps", type=int, default=10, help="steps per route; the first (compiling) is apart")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="folder for routes.json")
    return parser.parse_args(argv)


def make_params(width: int, layers: int) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(0), layers)
    return {
        f"layer{i}": {"w": jax.random.normal(k, (width, width)) / width**0.5, "b": jnp.zeros(width)}
        for i, k in enumerate(keys)
    }


def loss_fn(params: dict, x: jax.Array) -> jax.Array:
    for layer in params.values():
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return jnp.mean(x**2)


def timed(step: Callable[[Any, Any], tuple[Any, Any]], params: Any, state: Any, steps: int) -> dict:
    """The first step's seconds and the median of the others, each waited for."""
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        params, state = jax.block_until_ready(step(params, state))
        seconds.append(time.perf_counter() - start)
    return {"first_step_s": seconds[0], "median_step_s": statistics.median(seconds[1:])}


def run(route: str, args: argparse.Namespace, root: str) -> dict:
    """``args.steps`` steps of ``route`` ("split", "in_jit" or "plain") on a fresh copy of the model."""
    params = make_params(args.width, args.layers)
    x = jax.random.normal(jax.random.PRNGKey(1), (64, args.width))
    inner = optax.adamw(1e-3, weight_decay=0.1)
    state_bytes = 2 * sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    tx = inner
    if route != "plain":
        tx = jax_mlp.mlp_offload(
            inner, paths=[f"{root}/{route}"], subgroup_size=args.subgroup_size, host_cache=2 * state_bytes
        )
    if route == "split":
        grads_of, apply_updates = jax.jit(jax.grad(loss_fn)), jax.jit(optax.apply_updates)

        def step(params, state):
            updates, state = tx.update(grads_of(params, x), state, params)
            return apply_updates(params, updates), state

    else:

        @jax.jit
        def step(params, state):
            updates, state = tx.update(jax.grad(loss_fn)(params, x), state, params)
            return optax.apply_updates(params, updates), state

    result = timed(step, params, tx.init(params), args.steps)
    if route != "plain":
        tx.close(delete=True)
    return {**result, "state_bytes": state_bytes}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="jax_mlp_routes_") as root:
        routes = {route: run(route, args, root) for route in ("split", "in_jit", "plain")}
    result = {
        "backend": jax.default_backend(),
        "params": sum(leaf.size for leaf in jax.tree.leaves(make_params(args.width, args.layers))),
        "routes": routes,
        "in_jit_over_split": routes["in_jit"]["median_step_s"] / routes["split"]["median_step_s"],
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    print_and_save(result, args.out / "routes.json" if args.out else None)
    return result


if __name__ == "__main__":
    main()
