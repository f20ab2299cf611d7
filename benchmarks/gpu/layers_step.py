"""GPU check of the layer-streamed step (``jax_mlp.stream_layers``): params, grads and state in the tiers.

A stack of MLP blocks (bf16 params, fp32 masters as remainders, adamw) trains on a local directory
with the default options, against the same model held on the device (jitted ``jax.grad`` of the
whole model and optax), in one run. Reported side by side:

* ``step``: the median streamed step, the same step with every record in a host cache larger than
  the model (``compute_s``: no disk on its path), the in-memory step, and their ratios;
* ``tokens_per_s``: streamed and in memory;
* ``device_memory``: the device's peak bytes in use during the streamed steps (``memory_stats``,
  where the backend has it) against the model's params and against one layer's;
* ``exact``: the streamed params after the steps against the same per-layer programs' result
  updated in memory by optax (the largest difference over ``max|p|``, and the displacement's).

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


def stack() -> jax_mlp.LayerStack:
    def embed(outer, batch):
        return outer["embedding"][batch["tokens"]]

    def layer(p, x):
        return x + (jax.nn.gelu(x @ p["up"]) @ p["down"]).astype(x.dtype)

    def head(outer, x, batch):
        logits = (x @ outer["head"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return jax_mlp.LayerStack(embed, layer, head)


def model(layers: int, width: int, vocab: int) -> tuple[dict, dict]:
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    bf16 = jnp.bfloat16
    outer = {
        "embedding": (jax.random.normal(keys[0], (vocab, width)) * 0.02).astype(bf16),
        "head": (jax.random.normal(keys[1], (width, vocab)) / np.sqrt(width)).astype(bf16),
    }
    stacked = {
        "up": (jax.random.normal(keys[2], (layers, width, 4 * width)) / np.sqrt(width)).astype(bf16),
        "down": (jax.random.normal(keys[3], (layers, 4 * width, width)) / np.sqrt(8 * width)).astype(bf16),
    }
    return outer, stacked


def batch_at(step: int, tokens: int, vocab: int) -> dict:
    rng = np.random.default_rng(step)
    return {
        "tokens": jnp.asarray(rng.integers(0, vocab, tokens)),
        "targets": jnp.asarray(rng.integers(0, vocab, tokens)),
    }


def streamed(outer, stacked, steps: int, tokens: int, vocab: int, **options) -> dict:
    """Median step and peak device bytes of ``steps`` streamed steps (after a first one), and the params."""
    tx = optax.adamw(1e-3)
    with jax_mlp.stream_layers(stack(), tx, master_dtype=jnp.float32, **options) as stream:
        state = stream.init(outer, stacked)
        seconds = []
        for step in range(steps + 1):
            start = time.perf_counter()
            loss, state = stream.step(state, batch_at(step, tokens, vocab))
            jax.block_until_ready(loss)
            seconds.append(time.perf_counter() - start)
        peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
        return {"step_s": statistics.median(seconds[1:]), "peak_bytes": peak, "params": stream.params()}


def in_memory(outer, stacked, steps: int, tokens: int, vocab: int) -> dict:
    """The same model on the device: jitted grads of the whole model, optax with fp32 masters."""
    s = stack()
    layers = jax.tree.leaves(stacked)[0].shape[0]
    tree = {"layers": [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(layers)], "outer": outer}
    masters = jax.tree.map(lambda x: x.astype(jnp.float32), tree)
    tx = optax.adamw(1e-3)
    opt_state = tx.init(masters)

    @jax.jit
    def step(tree, masters, opt_state, batch):
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), jax.grad(s.loss)(tree, batch))
        updates, opt_state = tx.update(grads, opt_state, masters)
        masters = optax.apply_updates(masters, updates)
        return jax.tree.map(lambda m, p: m.astype(p.dtype), masters, tree), masters, opt_state

    seconds = []
    for i in range(steps + 1):
        start = time.perf_counter()
        tree, masters, opt_state = step(tree, masters, opt_state, batch_at(i, tokens, vocab))
        jax.block_until_ready(tree)
        seconds.append(time.perf_counter() - start)
    stacked_back = jax.tree.map(lambda *xs: jnp.stack(xs), *tree["layers"])
    return {"step_s": statistics.median(seconds[1:]), "params": (tree["outer"], stacked_back)}


def worst(a, b, base) -> float:
    """The largest ``|a - b|`` over ``max|base|``, leaf by leaf."""
    ratios = []
    for x, y, z in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(base), strict=True):
        x, y, z = (np.asarray(v, np.float64) for v in (x, y, z))
        ratios.append(float(np.max(np.abs(x - y)) / max(np.max(np.abs(z)), 1e-30)))
    return max(ratios)


def main(argv: list[str] | None = None) -> dict:
    args = gpu_arguments(argv, __doc__)
    layers, width, vocab, tokens, steps = (4, 64, 128, 32, 3) if args.dry_run else (24, 2048, 32768, 8192, 4)
    outer, stacked = model(layers, width, vocab)
    params_bytes = sum(x.nbytes for x in jax.tree.leaves((outer, stacked)))
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(stacked)) // layers
    with tempfile.TemporaryDirectory(prefix="jax_mlp_gpu_layers_") as directory:
        disk = streamed(outer, stacked, steps, tokens, vocab, paths=[os.path.join(directory, "disk")])
        cached = streamed(
            outer,
            stacked,
            steps,
            tokens,
            vocab,
            paths=[os.path.join(directory, "cached")],
            host_cache=16 * params_bytes,
        )
    memory = in_memory(outer, stacked, steps, tokens, vocab)
    p0 = (outer, stacked)
    displacement = jax.tree.map(lambda p, q: p.astype(jnp.float32) - q.astype(jnp.float32), memory["params"], p0)
    streamed_displacement = jax.tree.map(lambda p, q: p.astype(jnp.float32) - q.astype(jnp.float32), disk["params"], p0)
    result = {
        "device": str(jax.devices()[0]),
        "dry_run": args.dry_run,
        "layers": layers,
        "params_bytes": params_bytes,
        "tokens_per_step": tokens,
        "step": {
            "streamed_s": disk["step_s"],
            "compute_s": cached["step_s"],
            "in_memory_s": memory["step_s"],
            "streamed_over_compute": disk["step_s"] / cached["step_s"],
            "streamed_over_in_memory": disk["step_s"] / memory["step_s"],
        },
        "tokens_per_s": {"streamed": tokens / disk["step_s"], "in_memory": tokens / memory["step_s"]},
        "device_memory": {
            "peak_bytes": disk["peak_bytes"],
            "over_params": None if disk["peak_bytes"] is None else disk["peak_bytes"] / params_bytes,
            "over_layer": None if disk["peak_bytes"] is None else disk["peak_bytes"] / layer_bytes,
        },
        "exact": {
            "streamed_vs_cached_bitwise": all(
                np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
                for a, b in zip(jax.tree.leaves(disk["params"]), jax.tree.leaves(cached["params"]), strict=True)
            ),
            "vs_in_memory_over_max_p": worst(disk["params"], memory["params"], memory["params"]),
            "displacement_vs_in_memory": worst(streamed_displacement, displacement, displacement),
        },
    }
    return save(result, args.out, "layers_step.json")


if __name__ == "__main__":
    main()
