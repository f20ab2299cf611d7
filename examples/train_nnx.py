"""Train a small Flax NNX MLP with its AdamW state offloaded by ``jax_mlp``.

The data is generated here: a fixed random "teacher" network maps Gaussian inputs to regression
targets, and the student MLP learns to imitate it. Nothing is downloaded.

By default the optimizer state (about 4.3 MiB of AdamW moments for ~0.57M params) is several times
the 1 MiB host cache and is cut into 256 KiB subgroups, so every update streams most of the state
from disk and back. The state lives in a fresh temporary directory (two sub-directories, so both
"paths" of the multi-path scheduler are used) that is removed at the end; give ``--paths`` to put it
elsewhere, e.g. one directory on a local NVMe drive and one on a parallel file system.

The train step is split in two, because ``mlp_offload`` streams data to and from storage and so
cannot run inside ``jit``:

1. the loss and gradients are computed by a jitted function (``nnx.jit``);
2. ``optimizer.update(model, grads)`` runs eagerly, outside jit.

Run it with::

    python examples/train_nnx.py --steps 300

It exits with status 1 if the final loss is not at least 30% below the initial loss.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from tqdm import tqdm

import jax_mlp

IN_FEATURES = 64
OUT_FEATURES = 16
TEACHER_HIDDEN = 128
BATCH_SIZE = 256
EVAL_SIZE = 2048
REQUIRED_IMPROVEMENT = 0.30


class MLP(nnx.Module):
    """Input projection, two hidden layers and a linear head, with GELU activations."""

    def __init__(self, hidden: int, *, rngs: nnx.Rngs):
        self.inp = nnx.Linear(IN_FEATURES, hidden, rngs=rngs)
        self.hidden1 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.hidden2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, OUT_FEATURES, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.gelu(self.inp(x))
        x = x + nnx.gelu(self.hidden1(x))
        x = x + nnx.gelu(self.hidden2(x))
        return self.out(x)


def make_teacher(key: jax.Array):
    """A fixed random two-layer tanh network whose outputs have roughly unit variance."""
    k1, k2 = jax.random.split(key)
    w1 = jax.random.normal(k1, (IN_FEATURES, TEACHER_HIDDEN)) / jnp.sqrt(IN_FEATURES)
    w2 = jax.random.normal(k2, (TEACHER_HIDDEN, OUT_FEATURES)) / jnp.sqrt(TEACHER_HIDDEN)

    def teacher(x: jax.Array) -> jax.Array:
        return 1.5 * jnp.tanh(2.0 * x @ w1) @ w2

    return teacher


def mse(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{int(nbytes)} B" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def format_stats(stats: dict[str, Any]) -> str:
    """One ``name  value`` line per entry of ``UpdateStats.as_dict()``, with readable units."""
    lines = []
    width = max(len(name) for name in stats)
    for name, value in stats.items():
        if name.startswith("bytes_"):
            text = _size(value)
        elif name == "seconds" or name.endswith("_s"):
            text = f"{value * 1e3:.1f} ms"
        else:
            text = str(value)
        lines.append(f"  {name:<{width}}  {text}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument(
        "--paths",
        nargs="+",
        default=None,
        help="directories for the offloaded state (empty or new; they must not hold another run's state). "
        "Default: two sub-directories of a fresh temporary directory, removed at the end",
    )
    parser.add_argument("--host-cache", default="1MiB", help="host RAM cache for optimizer-state records")
    parser.add_argument("--subgroup-size", default="256KiB", help="bytes of optimizer state streamed at a time")
    parser.add_argument("--hidden", type=int, default=512, help="width of the student MLP")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for the teacher, the data and the model")
    parser.add_argument("--log-every", type=int, default=25, help="print the loss every this many steps")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.log_every < 1:
        parser.error("--steps and --log-every must be at least 1")
    return args


def _train(args: argparse.Namespace, paths: list[str], *, delete: bool) -> tuple:
    """The training run; returns the initial and final eval loss, the last stats and timings."""
    key = jax.random.key(args.seed)
    teacher_key, data_key, eval_key, model_key = jax.random.split(key, 4)
    teacher = make_teacher(teacher_key)
    eval_x = jax.random.normal(eval_key, (EVAL_SIZE, IN_FEATURES))
    eval_y = teacher(eval_x)

    model = MLP(args.hidden, rngs=nnx.Rngs(model_key))
    num_params = sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))

    offload = jax_mlp.mlp_offload(
        optax.adamw(args.lr, weight_decay=1e-4),
        paths=paths,
        host_cache=args.host_cache,
        subgroup_size=args.subgroup_size,
    )
    # Global transformations such as gradient clipping go before mlp_offload, which sees one
    # subgroup of the parameters at a time.
    tx = optax.chain(optax.clip_by_global_norm(1.0), offload)
    try:
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def loss_and_grads(model: MLP, step: jax.Array) -> tuple[jax.Array, Any]:
            x = jax.random.normal(jax.random.fold_in(data_key, step), (BATCH_SIZE, IN_FEATURES))
            return nnx.value_and_grad(mse)(model, x, teacher(x))

        eval_loss = nnx.jit(mse)

        initial_loss = float(eval_loss(model, eval_x, eval_y))
        print(
            f"model: {num_params:,} params; AdamW state ~{_size(2 * 4 * num_params)} offloaded to "
            f"{', '.join(paths)} with a {args.host_cache} host cache and {args.subgroup_size} subgroups"
        )
        print(f"initial eval loss {initial_loss:.4f}")

        update_seconds = []
        start = time.perf_counter()
        # The bar is shown on a terminal only; the periodic loss lines are printed everywhere.
        with tqdm(range(1, args.steps + 1), desc="train", unit="step", disable=None, dynamic_ncols=True) as bar:
            for step in bar:
                loss, grads = loss_and_grads(model, jnp.asarray(step))
                tick = time.perf_counter()
                optimizer.update(model, grads)  # eager: streams the AdamW state through the device
                jax.block_until_ready(nnx.state(model, nnx.Param))
                update_seconds.append(time.perf_counter() - tick)
                loss = float(loss)
                bar.set_postfix(loss=f"{loss:.4f}", update=f"{update_seconds[-1] * 1e3:.0f}ms")
                if step % args.log_every == 0 or step == args.steps:
                    bar.write(
                        f"step {step:5d}  train loss {loss:.4f}  optimizer update {update_seconds[-1] * 1e3:6.1f} ms"
                    )
        elapsed = time.perf_counter() - start

        final_loss = float(eval_loss(model, eval_x, eval_y))
        stats = offload.stats.as_dict()
    finally:
        offload.close(delete=delete)
    return initial_loss, final_loss, stats, update_seconds, elapsed


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Trains the demo model and returns its initial and final eval loss and the last update's stats."""
    args = parse_args(argv)
    temp_dir = tempfile.mkdtemp(prefix="jax_mlp_demo_") if args.paths is None else None
    paths = args.paths or [f"{temp_dir}/path0", f"{temp_dir}/path1"]
    try:
        initial_loss, final_loss, stats, update_seconds, elapsed = _train(args, paths, delete=temp_dir is not None)
    finally:
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)

    ratio = final_loss / initial_loss
    print()
    print(
        f"trained {args.steps} steps in {elapsed:.1f} s; optimizer update: first {update_seconds[0] * 1e3:.0f} ms "
        f"(compiles), median {statistics.median(update_seconds) * 1e3:.1f} ms"
    )
    print(f"initial eval loss  {initial_loss:.4f}")
    print(f"final eval loss    {final_loss:.4f}")
    print(f"final / initial    {ratio:.3f}  ({(1 - ratio) * 100:.1f}% lower)")
    print(f"offload stats of the last update (step {stats['step']}):")
    print(format_stats(stats))
    return {"initial_loss": initial_loss, "final_loss": final_loss, "stats": stats}


def _cli() -> int:
    result = main()
    if not result["final_loss"] <= (1 - REQUIRED_IMPROVEMENT) * result["initial_loss"]:
        print(
            f"FAILED: the final loss {result['final_loss']:.4f} is not at least {REQUIRED_IMPROVEMENT:.0%} below "
            f"the initial loss {result['initial_loss']:.4f}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
