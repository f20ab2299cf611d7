"""Train a Flax linen MLP with ``flax.training.train_state.TrainState`` and offloaded AdamW state.

The data is generated here: a fixed random "teacher" network maps Gaussian inputs to targets, and
the student MLP learns to imitate it. Nothing is downloaded.

``TrainState.apply_gradients`` calls ``tx.update``. Called eagerly, outside jit, ``mlp_offload``'s
update streams the state through the device; traced inside jit it would run on the host CPU (see
docs/usage.md, "Which route runs where"). The train step is therefore split in two:

1. ``grads_of`` computes the loss and gradients under ``jax.jit``;
2. ``state.apply_gradients(grads=grads)`` runs eagerly: ``tx.update`` streams the AdamW state through
   the device, and ``optax.apply_updates`` adds the updates to the params.

Run it with::

    python examples/train_linen.py --steps 300

It exits with status 1 if the final loss is not at least 30% below the initial loss.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState
from offload_options import add_offload_arguments, state_paths

import jax_mlp

IN_FEATURES = 32
OUT_FEATURES = 8
BATCH_SIZE = 128
EVAL_SIZE = 1024
REQUIRED_IMPROVEMENT = 0.30


class MLP(nn.Module):
    """Two hidden GELU layers with a residual connection, and a linear head."""

    hidden: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.gelu(nn.Dense(self.hidden)(x))
        x = x + nn.gelu(nn.Dense(self.hidden)(x))
        return nn.Dense(OUT_FEATURES)(x)


def teacher(x: jax.Array) -> jax.Array:
    """A fixed random network with outputs of roughly unit variance."""
    k1, k2 = jax.random.split(jax.random.key(1234))
    w1 = jax.random.normal(k1, (IN_FEATURES, 64)) / jnp.sqrt(IN_FEATURES)
    w2 = jax.random.normal(k2, (64, OUT_FEATURES)) / 8.0
    return 1.5 * jnp.tanh(2.0 * x @ w1) @ w2


def mse(params: Any, apply_fn: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((apply_fn({"params": params}, x) - y) ** 2)


@jax.jit
def grads_of(state: TrainState, x: jax.Array, y: jax.Array) -> tuple[jax.Array, Any]:
    """The jitted half of the step: loss and gradients. ``apply_gradients`` runs outside jit."""
    return jax.value_and_grad(mse)(state.params, state.apply_fn, x, y)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_offload_arguments(parser, steps=300, host_cache="256KiB", subgroup_size="64KiB")
    parser.add_argument("--hidden", type=int, default=256, help="width of the MLP")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the init and the data")
    parser.add_argument("--log-every", type=int, default=50, help="print the loss every this many steps")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.log_every < 1 or args.hidden < 1:
        parser.error("--steps, --hidden and --log-every must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Trains the linen MLP with offloaded AdamW state.

    Args:
      argv: the command-line arguments; None reads ``sys.argv``.

    Returns:
      ``initial_loss`` and ``final_loss`` (on held-out data), ``step`` (the ``TrainState``'s) and
      ``stats`` (the last update's ``UpdateStats.as_dict()``).
    """
    args = parse_args(argv)
    with state_paths(args.paths, count=2, prefix="jax_mlp_linen_") as (paths, temporary):
        init_key, data_key, eval_key = jax.random.split(jax.random.key(args.seed), 3)
        model = MLP(args.hidden)
        eval_x = jax.random.normal(eval_key, (EVAL_SIZE, IN_FEATURES))
        eval_y = teacher(eval_x)
        offload = jax_mlp.mlp_offload(
            optax.adamw(args.lr, weight_decay=1e-4),
            paths=paths,
            host_cache=args.host_cache,
            subgroup_size=args.subgroup_size,
        )
        try:
            # Global transformations go before mlp_offload, which sees one subgroup of params at a time.
            state = TrainState.create(
                apply_fn=model.apply,
                params=model.init(init_key, eval_x[:1])["params"],
                tx=optax.chain(optax.clip_by_global_norm(1.0), offload),
            )
            initial_loss = float(mse(state.params, model.apply, eval_x, eval_y))
            print(f"initial eval loss {initial_loss:.4f}")
            for step in range(1, args.steps + 1):
                x = jax.random.normal(jax.random.fold_in(data_key, step), (BATCH_SIZE, IN_FEATURES))
                loss, grads = grads_of(state, x, teacher(x))
                state = state.apply_gradients(grads=grads)  # eager: tx.update streams the offloaded state
                if step % args.log_every == 0 or step == args.steps:
                    print(f"step {step:5d}  train loss {float(loss):.4f}  update {offload.stats.seconds * 1e3:.1f} ms")
            final_loss = float(mse(state.params, model.apply, eval_x, eval_y))
            stats = offload.stats
        finally:
            offload.close(delete=temporary)
    print(f"initial eval loss  {initial_loss:.4f}")
    print(f"final eval loss    {final_loss:.4f}  ({(1 - final_loss / initial_loss) * 100:.1f}% lower)")
    print(stats.summary())
    return {"initial_loss": initial_loss, "final_loss": final_loss, "step": int(state.step), "stats": stats.as_dict()}


def _cli() -> int:
    result = main()
    if result["final_loss"] > (1 - REQUIRED_IMPROVEMENT) * result["initial_loss"]:
        print(
            f"FAILED: the final loss is not at least {REQUIRED_IMPROVEMENT:.0%} below the initial loss", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
