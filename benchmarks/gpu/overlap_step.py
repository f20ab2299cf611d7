"""GPU check of the overlapped step: the backward's hand-over of the grads must not stall the device.

An MLP of tanh layers trains with ``mlp_offload(adam)`` on a local directory, its state four times
the host cache, split (grads, then ``update``) and overlapped (``offload.overlap`` in the loss),
interleaved, in one run. Reported side by side:

* ``backward``: the jitted forward and backward alone, without and with the hand-over (its
  ``io_callback``s copy each leaf's grads to the host as it is made): their ratio is the stall;
* ``step``: the median step split and overlapped, and how many subgroups ran before ``update``;
* ``exact``: whether the two routes' params are bitwise equal after the steps.

Not run on a GPU yet. ``--dry-run`` uses tiny sizes on whatever backend is there, to check the script.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(__file__))
from bench import gpu_arguments, save

import jax_mlp


def loss(params: dict, x: jax.Array) -> jax.Array:
    for i in range(len(params)):
        x = jnp.tanh(x @ params[f"w{i}"])
    return jnp.mean(x**2)


def timed_backward(grads_of, params: dict, x: jax.Array, repeats: int) -> float:
    jax.block_until_ready(grads_of(params, x))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(grads_of(params, x))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def train(params: dict, x: jax.Array, directory: str, steps: int, overlapped: bool) -> dict:
    state_bytes = 2 * sum(p.nbytes for p in jax.tree.leaves(params))
    offload = jax_mlp.mlp_offload(  # every step overlapped: this measures the mechanism, not the timed choice
        optax.adam(1e-3), paths=[directory], host_cache=state_bytes // 4, overlap_mode="always"
    )
    grads_of = jax.jit(jax.grad(lambda p, b: loss(offload.overlap(p) if overlapped else p, b)))
    seconds, early = [], []
    with offload:
        state = offload.init(params)
        backward = timed_backward(grads_of, params, x, 3) if overlapped else None  # before the first update
        for _ in range(steps):
            start = time.perf_counter()
            updates, state = offload.update(grads_of(params, x), state, params)
            params = jax.block_until_ready(optax.apply_updates(params, updates))
            seconds.append(time.perf_counter() - start)
            early.append(offload.stats.overlapped)
        offload.close(delete=True)
    return {
        "params": params,
        "median_step_s": statistics.median(seconds[1:]),
        "overlapped": early,
        "backward": backward,
    }


def main(argv: list[str] | None = None) -> dict:
    args = gpu_arguments(argv, __doc__)
    width, layers, rows, steps = (256, 4, 64, 3) if args.dry_run else (4096, 16, 8192, 6)
    keys = jax.random.split(jax.random.PRNGKey(0), layers)
    params = {f"w{i}": jax.random.normal(k, (width, width)) / np.sqrt(width) for i, k in enumerate(keys)}
    x = jnp.ones((rows, width))
    plain_backward = timed_backward(jax.jit(jax.grad(loss)), params, x, 3)
    with tempfile.TemporaryDirectory(prefix="jax_mlp_gpu_overlap_") as directory:
        split = train(params, x, os.path.join(directory, "split"), steps, overlapped=False)
        overlapped = train(params, x, os.path.join(directory, "overlap"), steps, overlapped=True)
    exact = all(
        np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
        for a, b in zip(jax.tree.leaves(split["params"]), jax.tree.leaves(overlapped["params"]), strict=True)
    )
    result = {
        "device": str(jax.devices()[0]),
        "dry_run": args.dry_run,
        "params_bytes": sum(p.nbytes for p in jax.tree.leaves(params)),
        "backward": {
            "plain_s": plain_backward,
            "handing_over_s": overlapped["backward"],
            "stall": overlapped["backward"] / plain_backward,
        },
        "step": {
            "split_s": split["median_step_s"],
            "overlapped_s": overlapped["median_step_s"],
            "overlapped_over_split": overlapped["median_step_s"] / split["median_step_s"],
            "subgroups_before_update": overlapped["overlapped"],
        },
        "exact": exact,
    }
    return save(result, args.out, "overlap_step.json")


if __name__ == "__main__":
    main()
