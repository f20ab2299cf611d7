"""A GPT whose params, grads and AdamW state all live on disk, streamed a layer at a time.

The model is ``--layers`` transformer blocks (flax NNX, made with ``nnx.vmap``, so their params are
stacked on axis 0) between an embedding and a head. ``jax_mlp.stream_layers`` trains it with a
host-driven loop of jitted per-layer programs: each block's params are read from the tiers as the
forward reaches it and again in the backward, each block's grads go to the update as soon as its
backward returns, and the new params and AdamW state are written back. The device (and host RAM)
holds about two blocks, not the model: a model larger than host RAM trains, layer by layer. With
``--layer-init`` the blocks are made one at a time straight into the tiers, so not even the
initial model is ever whole in memory.

    python examples/layered_gpt.py --steps 60
    python examples/layered_gpt.py --layers 24 --d-model 1024 --layer-init --steps 3   # about 300M params

``--compare`` steps the same model with ``jax.grad`` and plain optax in memory from the params the
stream holds, each step, and prints the largest deviation of a step (the contract: 1e-5 of max|p|).
``--clipping defer`` defers each update to the next forward; ``--activations DIR`` keeps the blocks'
inputs in files there (docs/layers.md). The data is the docstrings of the Python standard library
(``train_gpt.py``'s corpus): nothing is downloaded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import resource
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from train_gpt import VOCAB, Batches, build_corpus, encode

import jax_mlp


class Block(nnx.Module):
    """A pre-norm transformer block: causal attention, then a GELU MLP, each with a residual."""

    def __init__(self, d_model: int, heads: int, *, rngs: nnx.Rngs):
        self.heads = heads
        self.norm1 = nnx.LayerNorm(d_model, rngs=rngs)
        self.qkv = nnx.Linear(d_model, 3 * d_model, rngs=rngs)
        self.out = nnx.Linear(d_model, d_model, rngs=rngs)
        self.norm2 = nnx.LayerNorm(d_model, rngs=rngs)
        self.up = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
        self.down = nnx.Linear(4 * d_model, d_model, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, width = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(batch, length, 3 * self.heads, width // self.heads)
        q, k, v = jnp.split(qkv, 3, axis=2)
        x = x + self.out(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(batch, length, width))
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class Outer(nnx.Module):
    """Everything outside the blocks: token and position embeddings, the final norm and the head."""

    def __init__(self, vocab: int, seq_len: int, d_model: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
        self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, d_model)))
        self.norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, rngs=rngs)


def embed(outer: Outer, batch: dict) -> jax.Array:
    tokens = batch["inputs"]
    return outer.embed(tokens) + outer.position[: tokens.shape[1]]


def head(outer: Outer, x: jax.Array, batch: dict) -> jax.Array:
    logits = outer.head(outer.norm(x))
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def make_blocks(args: argparse.Namespace, count: int, first: int = 0) -> Block:
    """``count`` blocks from layer ``first`` on, stacked (``nnx.vmap``); each layer's init has a key of its own."""

    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key: jax.Array) -> Block:
        return Block(args.d_model, args.heads, rngs=nnx.Rngs(key))

    keys = jnp.stack([jax.random.fold_in(jax.random.key(args.seed), layer) for layer in range(first, first + count)])
    return make(keys)


def one_block(args: argparse.Namespace, index: int) -> nnx.State:
    """The params of block ``index`` alone, made as ``make_blocks`` makes it."""
    return jax.tree.map(lambda x: x[0], nnx.split(make_blocks(args, 1, index), nnx.Param)[1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=1, help="layer-major gradient accumulation")
    parser.add_argument(
        "--clipping", choices=("speculate", "defer"), default="speculate", help="when a clipped step's update runs"
    )
    parser.add_argument(
        "--activations", default="device", help="where each layer's input waits: device, pinned_host, or a directory"
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--paths", nargs="+", default=None, help="storage directories (default: two temp dirs)")
    parser.add_argument("--host-cache", default="64MiB")
    parser.add_argument("--subgroup-size", default="64MiB")
    parser.add_argument("--layer-init", action="store_true", help="make the blocks one at a time, into the tiers")
    parser.add_argument("--compare", action="store_true", help="train the same model in memory alongside")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--json", default=None, help="write the run's figures to this file")
    parser.add_argument("--params-hash", action="store_true", help="digest the final params, read a block at a time")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    tokens = encode(build_corpus())
    batches = Batches(tokens, args.batch_size, args.seq_len, args.seed)
    outer = Outer(len(VOCAB), args.seq_len, args.d_model, rngs=nnx.Rngs(args.seed))
    template = make_blocks(args, 1)  # one block's graph; its params are stacked on axis 0 (of 1)
    stack, outer_params, one = jax_mlp.nnx_layer_stack(outer, template, embed=embed, head=head)
    inner = optax.adamw(args.lr, weight_decay=0.1)
    paths = args.paths or [tempfile.mkdtemp(prefix="layered-gpt-nvme-"), tempfile.mkdtemp(prefix="layered-gpt-pfs-")]
    options = dict(paths=paths, host_cache=args.host_cache, subgroup_size=args.subgroup_size)
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(one))
    params = args.layers * layer_bytes + sum(x.nbytes for x in jax.tree.leaves(outer_params))
    print(f"{args.layers} blocks of {layer_bytes / 2**20:.1f} MiB, {params / 2**20:.1f} MiB of params in all")
    start = time.perf_counter()
    kept = args.activations if args.activations in ("device", "pinned_host") else pathlib.Path(args.activations)
    options.update(clipping=args.clipping, activations=kept, microbatches=args.microbatches)
    with jax_mlp.stream_layers(stack, inner, max_grad_norm=1.0, **options) as stream:
        if args.layer_init:
            state = stream.init(outer_params, layer_init=lambda i: one_block(args, i), num_layers=args.layers)
        else:
            state = stream.init(outer_params, nnx.split(make_blocks(args, args.layers), nnx.Param)[1])
        print(f"init: {time.perf_counter() - start:.1f} s")
        reference = _Reference(stack, stream.params(), inner, args.microbatches) if args.compare else None
        losses, step_seconds = [], []
        for step in range(1, args.steps + 1):
            inputs, targets = batches.next()
            batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}
            before = stream.params() if reference is not None else None
            tick = time.perf_counter()
            loss, state = stream.step(state, batch)
            losses.append(float(loss))
            step_seconds.append(time.perf_counter() - tick)
            if reference is not None:
                reference.step(before, batch, stream.params())
            if step % args.log_every == 0 or step == args.steps:
                stats = stream.stats
                moved = {p: f"{(stats.bytes_read[p] + stats.bytes_written[p]) / 2**20:.0f}MiB" for p in stats.paths}
                committed = f"step {stats.step} moved" if stats.step else "init wrote"  # a step commits in the next
                print(f"step {step:4d}  loss {losses[-1]:.3f}  {step_seconds[-1]:.2f} s  {committed} {moved}")
        tokens_per_s = args.batch_size * args.seq_len / float(np.median(step_seconds))
        result = {
            "layers": args.layers,
            "params_bytes": params,
            "first_loss": losses[0],
            "last_loss": losses[-1],
            "median_step_s": float(np.median(step_seconds)),
            "tokens_per_s": tokens_per_s,
            "rolled_back": stream.rolled_back,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        if reference is not None:
            result["max_deviation"] = max(reference.deviations)
        if args.params_hash:
            digest = hashlib.sha256()
            for index in range(args.layers + 1):  # one block at a time: the model may not fit in memory
                digest.update(b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(stream.unit_params(index))))
            result["params_hash"] = digest.hexdigest()[:16]
    print(
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; {tokens_per_s:,.0f} tokens/s; peak RSS "
        f"{result['peak_rss_bytes'] / 2**20:.0f} MiB against {params / 2**20:.0f} MiB of params"
    )
    if reference is not None:
        print(f"largest deviation of a step from plain optax in memory: {result['max_deviation']:.2e} of max|p|")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


class _Reference:
    """Plain optax in memory on the whole model (``jax.grad``, the same clipping), stepped from the streamed params.

    Training is chaotic: two free-running models drift apart from rounding alone (Adam turns a last-bit
    difference of a near-zero grad into a step of ``lr``). So each step starts from the params the
    stream holds, with the optimizer state of optax's own run, and the deviation is that of one step.
    """

    def __init__(self, stack: jax_mlp.LayerStack, streamed: tuple[Any, Any], inner: Any, microbatches: int):
        self.tx = optax.chain(optax.clip_by_global_norm(1.0), inner)
        self.state = self.tx.init(_tree(streamed))
        self.deviations: list[float] = []

        @jax.jit
        def step(tree: dict, state: Any, batch: dict) -> tuple[dict, Any]:
            # The micro-batches' grads, summed in order in float32 and averaged, as the stream accumulates them.
            parts = jax.tree.map(lambda x: x.reshape(microbatches, -1, *x.shape[1:]), batch)
            grads = [jax.grad(stack.loss)(tree, jax.tree.map(lambda x, m=m: x[m], parts)) for m in range(microbatches)]
            if microbatches > 1:
                total = jax.tree.map(lambda *gs: sum(g.astype(jnp.float32) for g in gs), *grads)
                grads = [jax.tree.map(lambda t, p: (t / microbatches).astype(p.dtype), total, tree)]
            updates, state = self.tx.update(grads[0], state, tree)
            return optax.apply_updates(tree, updates), state

        self._step = step

    def step(self, before: tuple[Any, Any], batch: dict, after: tuple[Any, Any]) -> None:
        """One optax step from ``before``; records its largest deviation from the stream's ``after``."""
        expected, self.state = self._step(_tree(before), self.state, batch)
        pairs = zip(jax.tree.leaves(_tree(after)), jax.tree.leaves(expected), strict=True)
        self.deviations.append(max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in pairs))


def _tree(streamed: tuple[Any, Any]) -> dict:
    """The model tree the inner optimizer sees, from ``(outer, stacked layers)``."""
    outer, layers = streamed
    count = jax.tree.leaves(layers)[0].shape[0]
    return {"layers": [jax.tree.map(lambda x, i=i: x[i], layers) for i in range(count)], "outer": outer}


if __name__ == "__main__":
    main(sys.argv[1:])
