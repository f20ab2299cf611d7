"""Pre-train a decoder LM with FSDP-sharded params and offloaded AdamW state: the recipe for a cluster.

This is the script a cluster user copies. It trains the demo's GPT (``train_gpt.py``: Flax NNX, its
model and its embedded corpus), with size flags, as a real pre-training run would:

- **FSDP.** Every param is sharded over a mesh of all devices (all processes' devices, once
  ``--distributed`` started ``jax.distributed``), along its largest axis that the mesh divides;
  the rest are replicated. It runs unchanged on 8 fake CPU devices and on GPUs.
- **bf16 params with fp32 masters.** The model computes in bf16; ``mlp_offload`` keeps an fp32
  master copy next to AdamW's moments, so nothing is lost to bf16 rounding.
- **The optimizer:** ``optax.chain(optax.clip_by_global_norm(1.0), mlp_offload(adamw(warmup-cosine)))``.
  The clip is global, so it goes before ``mlp_offload``, which sees one subgroup at a time.
- **Gradient accumulation:** ``accumulate_steps=--accumulate``; each optimizer step averages that
  many micro-batches on the device, and the state streams once per optimizer step.
- **Checkpoints:** an orbax ``CheckpointManager`` saves the params and the offloaded state every
  ``--save-every`` steps, asynchronously, keeping ``--keep``.
- **Resume:** ``--resume`` continues from the tiers when the paths still hold the run (a crash, a
  kill -9: they hold the last complete step, and the params come back from the fp32 masters), or
  else from the latest checkpoint (the paths were lost, e.g. new nodes). The batches depend only on
  the step, so a resumed run sees the data an uninterrupted one would.
- A progress bar, and one JSON line of offload telemetry per update (``--log-to``).

Run it with::

    python examples/pretrain.py --workdir /tmp/pretrain                  # one host, its devices
    XLA_FLAGS=--xla_force_host_platform_device_count=8 NPROC=24 python examples/pretrain.py --workdir /tmp/pt --steps 20
    python examples/pretrain.py --workdir /tmp/pretrain --resume        # after a crash, or to go on

On fake CPU devices, give XLA's CPU runtime more threads than devices (``NPROC``): with fewer, as
on 2 cores, the FSDP step's all-reduce waits for device threads that never come and XLA aborts.

See ``docs/multi_device.md`` for paths and launching one process per node.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm
from train_gpt import GPT, VOCAB, add_model_arguments, build_corpus, cross_entropy, encode

import jax_mlp

AXIS = "fsdp"


# ----------------------------------------------------------------------------------------- sharding


def fsdp_spec(shape: tuple[int, ...], devices: int) -> PartitionSpec:
    """Shards the largest axis that ``devices`` divides; replicates a leaf that has none (biases, norms)."""
    axes = [axis for axis in np.argsort(shape)[::-1] if shape[axis] % devices == 0 and shape[axis] >= devices]
    if not axes:
        return PartitionSpec()
    return PartitionSpec(*(AXIS if axis == axes[0] else None for axis in range(len(shape))))


def shardings_of(params: Any, mesh: Mesh) -> Any:
    """Each param's ``NamedSharding`` under FSDP over ``mesh``."""
    return jax.tree.map(lambda p: NamedSharding(mesh, fsdp_spec(p.shape, mesh.size)), params)


def place(tree: Any, shardings: Any) -> Any:
    """Puts host values (the same on every process) onto the devices, each process its own shards."""
    return jax.tree.map(
        lambda value, sharding: jax.make_array_from_callback(value.shape, sharding, lambda index: value[index]),
        tree,
        shardings,
    )


# ----------------------------------------------------------------------------------------- data


def batch_at(tokens: np.ndarray, step: int, micro: int, args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    """Micro-batch ``micro`` of optimizer step ``step``: random windows that depend on nothing else.

    A resumed run therefore sees exactly the data an uninterrupted run would.
    """
    rng = np.random.default_rng([args.seed, step, micro])
    starts = rng.integers(0, len(tokens) - args.seq_len - 1, args.batch_size)
    windows = tokens[starts[:, None] + np.arange(args.seq_len + 1)]
    return windows[:, :-1], windows[:, 1:]


# ----------------------------------------------------------------------------------------- model and optimizer


def new_model(args: argparse.Namespace) -> tuple[nnx.GraphDef, Any]:
    """The GPT's graph and its params in bf16, as host arrays (every process computes the same)."""
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        model = GPT(len(VOCAB), args.seq_len, args.d_model, args.layers, args.heads, rngs=nnx.Rngs(args.seed))
        graphdef, params = nnx.split(model, nnx.Param)
        params = jax.tree.map(lambda p: np.asarray(p.astype(jnp.bfloat16)), nnx.to_pure_dict(params))
    return graphdef, params


def make_inner(args: argparse.Namespace) -> optax.GradientTransformation:
    """AdamW with a linear warm-up and a cosine decay to a tenth, weight decay on matrices only."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, args.warmup, max(args.steps, args.warmup + 1), 0.1 * args.lr
    )
    return optax.adamw(schedule, b2=0.95, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))


def make_offload(args: argparse.Namespace, *, resume: bool) -> jax_mlp.OffloadTransformation:
    """The offloaded AdamW: fp32 masters, gradient accumulation, the run's paths and its telemetry log."""
    return jax_mlp.mlp_offload(
        make_inner(args),
        paths=args.paths,
        resume=resume,
        master_dtype=jnp.float32,
        master_storage="full",  # a crashed run resumes from the tiers alone: restore_params needs whole masters
        accumulate_steps=args.accumulate,
        host_cache=args.host_cache,
        subgroup_size=args.subgroup_size,
        log_to=args.log_to,
    )


def loss_and_grads_fn(graphdef: nnx.GraphDef, shardings: Any) -> Callable[..., tuple[jax.Array, Any]]:
    """The jitted forward and backward pass; the grads come back with the params' FSDP sharding."""

    def loss(params: Any, inputs: jax.Array, targets: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, nnx.State(params))
        return cross_entropy(model, inputs, targets).astype(jnp.float32)

    return jax.jit(jax.value_and_grad(loss), out_shardings=(None, shardings))


# ----------------------------------------------------------------------------------------- start or resume


class Start(NamedTuple):
    """Where a run starts: its params on the devices, the chain's state, and the step they are at."""

    params: Any
    opt_state: Any
    step: int
    source: str  # "fresh", "tiers" or "checkpoint step N"


def _tiers_hold_state(paths: list[str]) -> bool:
    """Whether every process still has something on its paths; all processes must agree."""
    mine = any(os.path.isdir(path) and os.listdir(path) for path in paths)
    everyone = multihost_utils.process_allgather(np.asarray(mine)) if jax.process_count() > 1 else np.asarray([mine])
    if everyone.any() and not everyone.all():
        raise SystemExit(
            "some processes' paths hold offloaded state and others' do not (a node was replaced?): clear the "
            "paths on every process, then --resume restores from the latest checkpoint"
        )
    return bool(everyone.all())


def start(args: argparse.Namespace, manager: ocp.CheckpointManager, host_params: Any, shardings: Any):
    """Starts fresh, or with ``--resume`` from the tiers or the latest checkpoint (see the module doc).

    Returns:
      The :class:`Start` and the ``mlp_offload`` transformation to train with.
    """
    clip = optax.clip_by_global_norm(1.0)
    if args.resume and _tiers_hold_state(args.paths):
        offload = make_offload(args, resume=True)
        opt_state = optax.chain(clip, offload).init(place(host_params, shardings))
        params = jax_mlp.restore_params(offload, _abstract(host_params, shardings))
        return Start(params, opt_state, int(opt_state[1].step), "tiers"), offload
    offload = make_offload(args, resume=False)
    latest = manager.latest_step() if args.resume else None
    if latest is None:
        if args.resume:
            print("--resume: the paths hold no state and there is no checkpoint yet; starting fresh")
        params = place(host_params, shardings)
        return Start(params, optax.chain(clip, offload).init(params), 0, "fresh"), offload
    like = _abstract(host_params, shardings)
    restored = manager.restore(
        latest,
        args=ocp.args.Composite(params=ocp.args.StandardRestore(like), opt_state=jax_mlp.OffloadRestore(offload, like)),
    )
    opt_state = (clip.init(like), restored["opt_state"])  # the restore initialised the offload: no tx.init
    return Start(restored["params"], opt_state, latest, f"checkpoint step {latest}"), offload


def _abstract(host_params: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s), host_params, shardings)


# ----------------------------------------------------------------------------------------- training


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Runs (or resumes) the pre-training run in ``--workdir`` and returns its summary."""
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
    tokens = encode(build_corpus())
    graphdef, host_params = new_model(args)
    shardings = shardings_of(host_params, mesh)
    batch_sharding = NamedSharding(mesh, PartitionSpec(AXIS) if args.batch_size % mesh.size == 0 else PartitionSpec())
    loss_and_grads = loss_and_grads_fn(graphdef, shardings)
    options = ocp.CheckpointManagerOptions(max_to_keep=args.keep)
    manager = ocp.CheckpointManager(os.path.abspath(args.checkpoints), options=options)
    run, offload = start(args, manager, host_params, shardings)
    tx = optax.chain(optax.clip_by_global_norm(1.0), offload)
    params, opt_state, losses = run.params, run.opt_state, []
    print(f"{jax.device_count()} devices, {jax.process_count()} processes; start: {run.source} (step {run.step})")
    try:
        bar = tqdm(range(run.step + 1, args.steps + 1), desc="pretrain", unit="step", disable=None, dynamic_ncols=True)
        for step in bar:
            micro_losses = []
            for micro in range(args.accumulate):
                inputs, targets = (place(x, batch_sharding) for x in batch_at(tokens, step, micro, args))
                loss, grads = loss_and_grads(params, inputs, targets)
                updates, opt_state = tx.update(grads, opt_state, params)  # streams the state on the last micro-step
                params = optax.apply_updates(params, updates)
                micro_losses.append(float(loss))
            losses.append(float(np.mean(micro_losses)))
            if step % args.save_every == 0 or step == args.steps:
                items = {"params": ocp.args.StandardSave(params), "opt_state": jax_mlp.OffloadSave(offload)}
                manager.save(step, args=ocp.args.Composite(**items))  # async: training goes on as it writes
            bar.set_postfix(loss=f"{losses[-1]:.3f}", update=f"{offload.stats.seconds * 1e3:.0f}ms", refresh=False)
            if step % args.log_every == 0 or step == args.steps:
                bar.write(f"step {step:5d}  loss {losses[-1]:.4f}")
        manager.wait_until_finished()
    finally:
        manager.close()
        offload.close()
    return {
        "start": run.source,
        "start_step": run.step,
        "step": int(opt_state[1].step),
        "losses": losses,
        "checkpoints": list(manager.all_steps()),
        "params": jax.tree.map(lambda p: np.asarray(jax.device_get(p)), params),
    }


# ----------------------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--workdir", required=True, help="the run's directory: state paths and checkpoints below it")
    parser.add_argument("--paths", nargs="+", default=None, help="state paths (default: WORKDIR/nvme WORKDIR/pfs)")
    parser.add_argument("--checkpoints", default=None, help="checkpoint directory (default: WORKDIR/checkpoints)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps in all (a resumed run goes on to it)")
    parser.add_argument("--accumulate", type=int, default=4, help="micro-batches averaged per optimizer step")
    add_model_arguments(parser, context="tokens")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per micro-batch, over all devices")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    parser.add_argument("--warmup", type=int, default=20, help="warm-up steps")
    parser.add_argument("--host-cache", default="4MiB", help="host RAM that may hold state records between updates")
    parser.add_argument("--subgroup-size", default="512KiB", help="bytes of optimizer state streamed at a time")
    parser.add_argument("--save-every", type=int, default=50, help="checkpoint every this many steps")
    parser.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    parser.add_argument("--resume", action="store_true", help="continue from the tiers, or the latest checkpoint")
    parser.add_argument(
        "--log-to", default=None, help="JSONL telemetry, one line per update (default: WORKDIR/log.jsonl)"
    )
    parser.add_argument("--log-every", type=int, default=10, help="print a line every this many steps")
    parser.add_argument("--seed", type=int, default=0, help="seed of the init and the batches")
    parser.add_argument("--distributed", action="store_true", help="call jax.distributed.initialize() (SLURM, MPI...)")
    args = parser.parse_args(argv)
    for name in ("steps", "accumulate", "layers", "d_model", "heads", "seq_len", "batch_size", "save_every", "keep"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    workdir = os.path.abspath(args.workdir)
    args.paths = args.paths or [os.path.join(workdir, "nvme"), os.path.join(workdir, "pfs")]
    args.checkpoints = args.checkpoints or os.path.join(workdir, "checkpoints")
    args.log_to = args.log_to or os.path.join(workdir, "log.jsonl")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parses the flags, starts ``jax.distributed`` if asked, and trains; returns the run's summary.

    Args:
      argv: the command-line arguments; None reads ``sys.argv``.

    Returns:
      ``start`` (fresh, tiers or checkpoint), ``start_step``, ``step`` (the final one), ``losses``
      (one per step run here), ``checkpoints`` (the steps kept) and ``params`` (numpy arrays).
    """
    args = parse_args(argv)
    if args.distributed:
        jax.distributed.initialize()
    os.makedirs(os.path.abspath(args.workdir), exist_ok=True)
    tick = time.perf_counter()
    result = train(args)
    summary = {key: result[key] for key in ("start", "start_step", "step", "checkpoints")}
    summary.update(final_loss=result["losses"][-1] if result["losses"] else None, seconds=time.perf_counter() - tick)
    print(json.dumps(summary))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["step"] > 0 else 1)
