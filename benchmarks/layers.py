"""The layer-streamed step (``jax_mlp.stream_layers``) on kernel-throttled devices, against its bounds.

For each model shape (few wide layers, many narrow ones; about the same params), on a device
throttled by the kernel (``devices.py``: loop-backed ext4 under a blkio cgroup), with the default
options:

- **the step**: the median of the timed steps of ``stream_layers``;
- **compute** ``F``: the same step with every record in a host cache larger than the model, on an
  unthrottled directory (no disk on its path: the per-layer programs, the update's programs and the
  library's own work);
- **disk** ``D``: the bytes the step moves on the device, counted by the library (its stats), over the
  throttle's rates, each direction on its own (the kernel throttles them apart): ``max(read / r, write / w)``;
- the ratio ``step / max(F, D)``;
- **tokens/s** against the same model with its params on the device (jitted ``jax.grad`` of the whole
  model and optax in memory).

Each shape runs ``--runs`` times on fresh devices. Needs root; writes ``layers.json`` into ``--out``.

    sudo python benchmarks/layers.py --rate 200MB/s --runs 3 --out results/
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import devices
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_mlp

SHAPES = {"few wide": (4, 1024), "many narrow": (32, 256)}
"""Layers and width of each model: an MLP block of ``width -> 4 width -> width`` per layer."""
TOKENS = 256


def stack() -> jax_mlp.LayerStack:
    def embed(outer, batch):
        return batch["x"] @ outer["w_in"]

    def layer(p, x):
        return x + jax.nn.gelu(x @ p["up"]) @ p["down"]

    def head(outer, x, batch):
        return jnp.mean(jnp.square(x @ outer["w_out"] - batch["y"]))

    return jax_mlp.LayerStack(embed, layer, head)


def model(layers: int, width: int) -> tuple[dict, dict]:
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    outer = {
        "w_in": jax.random.normal(keys[0], (32, width)) * 0.1,
        "w_out": jax.random.normal(keys[1], (width, 8)) * 0.1,
    }
    scale = 1 / np.sqrt(width)
    stacked = {
        "up": jax.random.normal(keys[2], (layers, width, 4 * width)) * scale,
        "down": jax.random.normal(keys[3], (layers, 4 * width, width)) * scale / 2,
    }
    return outer, stacked


def batch_at(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {
        "x": jnp.asarray(rng.normal(size=(TOKENS, 32)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(TOKENS, 8)), jnp.float32),
    }


def timed_steps(paths: list, steps: int, **options) -> tuple[list[float], list[jax_mlp.UpdateStats], int]:
    """Seconds and stats of each step after the first, and the bytes of the model's params."""
    outer, stacked = model(*options.pop("shape"))
    with jax_mlp.stream_layers(stack(), optax.adam(1e-3), paths=paths, **options) as stream:
        state = stream.init(outer, stacked)
        seconds, stats = [], []
        for step in range(steps + 1):
            start = time.perf_counter()
            loss, state = stream.step(state, batch_at(step))
            jax.block_until_ready(loss)
            if step:
                seconds.append(time.perf_counter() - start)
                stats.append(stream.stats)
    return seconds, stats, sum(x.nbytes for x in jax.tree.leaves((outer, stacked)))


def in_memory_tokens_per_s(shape: tuple[int, int], steps: int) -> float:
    """The same model with its params on the device: jitted grads of the whole model and optax."""
    outer, stacked = model(*shape)
    tree = {"layers": [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(shape[0])], "outer": outer}
    tx = optax.adam(1e-3)
    state = tx.init(tree)

    @jax.jit
    def step(tree, state, batch):
        updates, state = tx.update(jax.grad(stack().loss)(tree, batch), state, tree)
        return optax.apply_updates(tree, updates), state

    seconds = []
    for i in range(steps + 1):
        start = time.perf_counter()
        tree, state = step(tree, state, batch_at(i))
        jax.block_until_ready(tree)
        if i:
            seconds.append(time.perf_counter() - start)
    return TOKENS / statistics.median(seconds)


def parse(description: str, argv: list[str] | None) -> tuple[argparse.Namespace, float]:
    """The options of a benchmark on a throttled device (its rate each way, steps, runs, output folder), and
    the rate in bytes/s."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="200MB/s", help="the device's throttle, each way")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="results")
    args = parser.parse_args(argv)
    return args, jax_mlp.parse_rate(args.rate)


def save(result: dict, out: str, name: str) -> dict:
    """Writes ``result`` as ``name`` into the folder ``out``."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name), "w") as f:
        json.dump(result, f, indent=1)
    return result


def main(argv: list[str] | None = None) -> dict:
    args, rate = parse(__doc__, argv)
    rows = []
    for name, shape in SHAPES.items():
        with tempfile.TemporaryDirectory() as scratch:
            cached, _, params = timed_steps([scratch], args.steps, shape=shape, host_cache="4GiB")
        compute = statistics.median(cached)
        in_memory = in_memory_tokens_per_s(shape, args.steps)
        for run in range(args.runs):
            with devices.throttled_devices([devices.Throttle(rate, rate)], size=2 << 30) as made:
                devices.join(made)
                seconds, stats, _ = timed_steps([made.devices[0].mount], args.steps, shape=shape)
            step = statistics.median(seconds)
            moved = stats[len(stats) // 2]
            disk = max(sum(moved.bytes_read.values()) / rate, sum(moved.bytes_written.values()) / rate)
            row = {
                "shape": name,
                "layers": shape[0],
                "width": shape[1],
                "params_bytes": params,
                "run": run,
                "step_s": step,
                "compute_s": compute,
                "disk_s": disk,
                "step_over_bound": step / max(compute, disk),
                "bytes_read": sum(moved.bytes_read.values()),
                "bytes_written": sum(moved.bytes_written.values()),
                "tokens_per_s": TOKENS / step,
                "in_memory_tokens_per_s": in_memory,
            }
            rows.append(row)
            print(
                f"{name:12} run {run}: step {step:.2f} s, compute {compute:.2f} s, disk {disk:.2f} s, "
                f"{row['step_over_bound']:.2f}x the bound; {row['tokens_per_s']:.0f} tokens/s "
                f"({in_memory:.0f} in memory)"
            )
    return save({"rate": rate, "tokens_per_step": TOKENS, "rows": rows}, args.out, "layers.json")


if __name__ == "__main__":
    main()
