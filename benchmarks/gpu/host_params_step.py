"""GPU check of ``examples/host_params.py``'s step: params and grads in host memory, streamed a layer at a time.

The step is the example's: the jitted loss and gradients scan over the stacked layers, bringing each
layer's params from ``pinned_host`` to device memory and writing the grads back there, then
``mlp_offload(adam).apply`` streams the state (all in the host cache, ``flush="lazy"``, so no disk
I/O) and each subgroup's param and grad blocks through the device. Each figure is measured beside
the same step with the params in device memory:

* ``device_memory``: XLA's memory analysis of the compiled loss-and-gradient step at ``--layers`` and
  twice as many layers, and what one more layer adds to its temporary (device) bytes; with the params
  in host memory a layer should add only its activations, not its params and grads. On a GPU also
  the device's peak bytes in use after each variant ran (the host variant runs first).
* ``step``: the median seconds of the gradient step and of the update, for each variant.
* ``link``: the bytes the host variant moves over the host link per step beyond the device variant
  (the params in for the forward and again for the backward, the grads out; the update's grads and
  params in, new params out), per second of the time it adds, against a pinned copy of the params'
  bytes (``jax.device_put`` from ``pinned_host`` to device memory, and back).

``--dry-run`` uses tiny sizes on whatever backend is there (the CPU here, where XLA erases the memory
moves inside jit and reports no host bytes, so only the script is checked). Not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_mlp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
import host_params  # the example: its model and placement
from bench import gpu_arguments, save, timed  # beside this file

HOST, DEVICE = host_params.HOST, host_params.DEVICE
SIZES = {  # the example's flags: a GPU-sized model, and a tiny one for --dry-run
    "gpu": ["--layers", "8", "--d-model", "2048", "--heads", "16", "--seq-len", "1024", "--batch-size", "8"],
    "dry_run": ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4"],
}


def grad_step(args: argparse.Namespace, kind: str):
    """The example's jitted loss and gradients, with its params placed in memory ``kind`` on one device."""
    outer_def, block_def, start = host_params.build(args)
    mesh = jax.make_mesh((1,), (host_params.AXIS,), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
    placement = host_params.shardings(start, mesh, kind)
    loss = functools.partial(host_params.loss, outer_def, block_def)
    step = jax.jit(jax.value_and_grad(loss), out_shardings=(NamedSharding(mesh, P()), placement))
    tokens = np.zeros((args.batch_size, args.seq_len), np.int32)
    return jax.device_put(start, placement), step, tokens


def memory_analysis(args: argparse.Namespace, kind: str) -> dict:
    """XLA's memory analysis of the compiled step (host figures where the backend reports them)."""
    params, step, tokens = grad_step(args, kind)
    analysis = step.lower(params, tokens, tokens).compile().memory_analysis()
    names = ("argument", "output", "temp", "host_argument", "host_output", "host_temp")
    return {name: int(getattr(analysis, f"{name}_size_in_bytes", 0) or 0) for name in names}


def device_memory(argv: list[str], kind: str) -> dict:
    """The step's memory at ``--layers`` and twice as many, and what one more layer adds to its device temps."""
    args = host_params.parse_args(argv)
    twice = host_params.parse_args([*argv, "--layers", str(2 * args.layers)])
    one, two = memory_analysis(args, kind), memory_analysis(twice, kind)
    layer_params = sum(x.nbytes for x in jax.tree.leaves(host_params.build(args)[2]["layers"])) / args.layers
    per_layer = (two["temp"] - two["host_temp"] - one["temp"] + one["host_temp"]) / args.layers
    return {
        "layers": args.layers,
        "at_layers": one,
        "at_twice": two,
        "temp_per_layer": per_layer,
        "layer_params": layer_params,
    }


def step_times(argv: list[str], kind: str, repeats: int, directory: str) -> dict:
    """Median seconds of the gradient step and of the fused apply, with the whole state in the host cache."""
    args = host_params.parse_args(argv)
    params, step, tokens = grad_step(args, kind)
    state_bytes = 12 * sum(x.size for x in jax.tree.leaves(params))  # adam's moments and a master, at most
    tx = jax_mlp.mlp_offload(
        optax.adam(1e-4),
        paths=[os.path.join(directory, kind)],
        host_cache=2 * state_bytes + (64 << 20),
        flush="lazy",
        master_dtype=jnp.float32 if args.param_dtype == "bf16" else None,
    )
    holder = {"params": params, "state": tx.init(params), "grads": None}

    def gradients() -> None:
        loss, holder["grads"] = step(holder["params"], tokens, tokens)
        jax.block_until_ready((loss, holder["grads"]))

    def update() -> None:
        gradients()  # apply consumes the grads: each update gets fresh ones, whose time is taken off below
        holder["params"], holder["state"] = tx.apply(holder["grads"], holder["state"], holder["params"])
        jax.block_until_ready(holder["params"])

    grads_s = timed(gradients, repeats)
    update_s = timed(update, repeats) - grads_s
    kinds = sorted({x.sharding.memory_kind for x in jax.tree.leaves(holder["params"])})
    tx.close(delete=True)
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "grads_s": grads_s,
        "update_s": update_s,
        "kinds": kinds,
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
    }


def pinned_copy(nbytes: int, repeats: int) -> dict:
    """Bytes per second of a pinned copy of ``nbytes``: pinned_host to device memory, and back."""
    device = jax.devices()[0]
    pinned = jax.sharding.SingleDeviceSharding(device, memory_kind=HOST)
    on_device = jax.sharding.SingleDeviceSharding(device, memory_kind=DEVICE)
    host = jax.device_put(np.ones(max(1, nbytes // 4), np.float32), pinned).block_until_ready()
    there = jax.device_put(host, on_device).block_until_ready()
    return {
        "bytes": nbytes,
        "h2d": nbytes / timed(lambda: jax.device_put(host, on_device).block_until_ready(), repeats),
        "d2h": nbytes / timed(lambda: jax.device_put(there, pinned).block_until_ready(), repeats),
    }


def main(argv: list[str] | None = None) -> dict:
    args = gpu_arguments(argv, __doc__)
    device = jax.devices()[0]
    model = [*SIZES["dry_run" if args.dry_run else "gpu"], "--param-dtype", "bf16"]
    repeats = 2 if args.dry_run else 5
    result = {"device": str(device), "platform": device.platform, "jax": jax.__version__, "dry_run": args.dry_run}
    result["model"] = model
    result["device_memory"] = {kind: device_memory(model, kind) for kind in (HOST, DEVICE)}
    with tempfile.TemporaryDirectory(prefix="jax_mlp_gpu_host_params_") as directory:
        result["step"] = {kind: step_times(model, kind, repeats, directory) for kind in (HOST, DEVICE)}
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(host_params.build(host_params.parse_args(model))[2]))
    host, on_device = result["step"][HOST], result["step"][DEVICE]
    added = host["grads_s"] + host["update_s"] - on_device["grads_s"] - on_device["update_s"]
    moved = 6 * params_bytes  # in: params twice, the update's grads and params; out: grads, new params
    copy = pinned_copy(params_bytes, repeats)
    result["link"] = {
        "bytes_per_step": moved,
        "added_s": added,
        "bytes_per_added_s": moved / added if added > 0 else None,
        "pinned_copy": copy,
        "fraction_of_pinned_copy": moved / added / min(copy["h2d"], copy["d2h"]) if added > 0 else None,
    }
    return save(result, args.out, "host_params.json")


if __name__ == "__main__":
    main()
