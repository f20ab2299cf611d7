"""Compressed optimizer state: how much each int8 map loses on adam's moments, and what training loses.

A tiny language model (an embedding, one hidden layer, the logits) learns next-token distributions
of Zipf-distributed tokens: rare tokens give the tiny second moments that a linear int8 map rounds
to zero. The script trains it with fp32 adam, then

- quantizes the trained ``nu`` (and ``mu``) with six maps and reports the relative error of ``nu``,
  the share of non-zero ``nu`` decoded as zero, and the error of the adam direction ``mu / sqrt(nu)``;
- trains it again with ``quantized_state(adam, codec)`` for each codec and reports the final loss;
- times each codec's encoding and decoding of a large leaf, in nanoseconds per element.

It reaches the codecs through the public ``jax_mlp.quantized`` (``compress``/``decompress``: the int8
round trip is theirs); ``BLOCK``, the block size of the maps it compares, is the one docs/api.md gives
for the int8 codec (``tests/test_benchmarks.py`` checks the two agree).

    PYTHONPATH=. python benchmarks/state_codecs.py --out benchmarks/results/state_codecs.json
"""

from __future__ import annotations

import argparse
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import print_and_save

import jax_mlp
from jax_mlp.quantized import CODECS, compress, decompress

VOCAB, WIDTH, HIDDEN, BATCH = 512, 64, 128, 256
EPS = 1e-8  # adam's
BLOCK = 256  # values per block of the maps compared, as in quantized_state's int8 (docs/api.md#quantized_state)


def make_task(seed: int = 0) -> tuple[Callable[[int], tuple[jax.Array, jax.Array]], Any]:
    """The batch of a step (Zipf tokens, targets drawn from a fixed random next-token distribution),
    and the model's initial params."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    zipf = jnp.log(1.0 / jnp.arange(1, VOCAB + 1) ** 1.2)
    teacher = 3.0 * jax.random.normal(keys[0], (VOCAB, VOCAB))

    def batch(step: int) -> tuple[jax.Array, jax.Array]:
        key_tokens, key_targets = jax.random.split(jax.random.fold_in(keys[1], step))
        tokens = jax.random.categorical(key_tokens, zipf, shape=(BATCH,))
        return tokens, jax.random.categorical(key_targets, teacher[tokens])

    params = {
        "embed": 0.1 * jax.random.normal(keys[2], (VOCAB, WIDTH)),
        "hidden": {"w": jax.random.normal(keys[3], (WIDTH, HIDDEN)) / WIDTH**0.5, "b": jnp.zeros(HIDDEN)},
        "logits": {"w": jax.random.normal(keys[4], (HIDDEN, VOCAB)) / HIDDEN**0.5, "b": jnp.zeros(VOCAB)},
    }
    return batch, params


def loss_fn(params: Any, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    hidden = jax.nn.gelu(params["embed"][tokens] @ params["hidden"]["w"] + params["hidden"]["b"])
    logits = hidden @ params["logits"]["w"] + params["logits"]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def train(tx: optax.GradientTransformation, steps: int, seed: int = 0) -> tuple[list[float], Any, Any]:
    """Trains the task's model with ``tx``; returns the loss of every step, the params and the state."""
    batch, params = make_task(seed)
    state = tx.init(params)

    @jax.jit
    def step(params, state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for i in range(steps):
        params, state, loss = step(params, state, *batch(i))
        losses.append(float(loss))
    return losses, params, state


def final_loss(losses: list[float], window: int = 20) -> float:
    """The mean loss of the last ``window`` steps (a single batch's loss is noisy)."""
    return float(np.mean(losses[-window:]))


def _blocks(x: np.ndarray) -> np.ndarray:
    n = x.shape[-1]
    blocks = -(-n // BLOCK)
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, blocks * BLOCK - n)])
    return padded.reshape(*x.shape[:-1], blocks, BLOCK)


def _unblock(blocks: np.ndarray, n: int) -> np.ndarray:
    return blocks.reshape(*blocks.shape[:-2], -1)[..., :n]


def _blockwise(x: np.ndarray, values: np.ndarray, *, root: bool) -> np.ndarray:
    """Round trip of non-negative ``x`` through a blockwise absmax map (``root``: of ``sqrt(x)``)."""
    y = _blocks(np.sqrt(x) if root else x)
    scale = y.max(axis=-1, keepdims=True)
    normalized = y / np.where(scale > 0, scale, 1)
    codes = np.searchsorted((values[1:] + values[:-1]) / 2, normalized)
    decoded = values[codes] * scale
    return _unblock(decoded**2 if root else decoded, x.shape[-1])


def dynamic_map(*, signed: bool, decades: int = 7) -> np.ndarray:
    """The 256 sorted values of bitsandbytes' dynamic map in [-1, 1] (signed) or [0, 1], as int8 format 1 used.

    Decade ``i`` (from ``10**-(decades-1)`` up to 1) gets ``2**i`` fraction steps (twice as many when
    unsigned), at the midpoints of an even split of ``[0.1, 1]`` times the decade; 0 and 1 are exact
    (Dettmers, "8-bit approximations for parallelism in deep learning", arXiv 1511.04561).
    """
    values = [0.0, 1.0]
    for i in range(decades):
        steps = 2 ** (i + (0 if signed else 1))
        edges = np.linspace(0.1, 1.0, steps + 1)
        magnitudes = 10.0 ** (i - decades + 1) * (edges[:-1] + edges[1:]) / 2
        values += list(magnitudes) + (list(-magnitudes) if signed else [])
    return np.sort(np.asarray(values, np.float32))


def _block_float_of_sqrt(x: np.ndarray, mantissa: int) -> np.ndarray:
    """Round trip of finite non-negative ``x`` through 8-bit block floating point of ``sqrt(x)`` with
    ``mantissa`` fraction bits (what quantized_state does with 4), in numpy, for comparing fraction widths."""
    shift = np.uint32(23 - mantissa)
    prefix = ((np.sqrt(_blocks(x)).astype(np.float32).view(np.uint32) + (np.uint32(1) << (shift - 1))) >> shift).astype(
        np.int64
    )
    base = np.maximum(prefix.max(axis=-1, keepdims=True) - 255, 0)
    code = np.maximum(prefix - base, 0)
    root = np.where(code == 0, 0, (code + base) << int(shift)).astype(np.uint32).view(np.float32)
    return _unblock(root * root, x.shape[-1])


LINEAR = np.linspace(0.0, 1.0, 256, dtype=np.float32)
NU_MAPS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "linear absmax": lambda x: _blockwise(x, LINEAR, root=False),
    "dynamic map (bitsandbytes, torchao)": lambda x: _blockwise(x, dynamic_map(signed=False), root=False),
    "linear absmax of sqrt": lambda x: _blockwise(x, LINEAR, root=True),
    "dynamic map of sqrt (int8 format 1)": lambda x: _blockwise(x, dynamic_map(signed=False), root=True),
    "block float of sqrt, 3 fraction bits": lambda x: _block_float_of_sqrt(x, 3),
    "block float of sqrt, 4 fraction bits (quantized_state)": lambda x: np.asarray(
        decompress(compress(jnp.asarray(x), "int8", jnp.int32(0)))
    ),
}


def nu_errors(mu: list[np.ndarray], nu: list[np.ndarray]) -> dict[str, dict[str, float]]:
    """Per map: relative error of ``nu`` (median, 99th percentile), the share of non-zero ``nu``
    decoded as 0, and the relative L2 error and largest relative element error of ``mu / (sqrt(nu) + eps)``."""
    out = {}
    for name, round_trip in NU_MAPS.items():
        decoded = [round_trip(x) for x in nu]
        true, got = np.concatenate([x.ravel() for x in nu]), np.concatenate([x.ravel() for x in decoded])
        m = np.concatenate([x.ravel() for x in mu])
        nonzero = true > 0
        relative = np.abs(got[nonzero] - true[nonzero]) / true[nonzero]
        direction, direction_got = m / (np.sqrt(true) + EPS), m / (np.sqrt(got) + EPS)
        out[name] = {
            "nu_rel_err_median": float(np.median(relative)),
            "nu_rel_err_p99": float(np.quantile(relative, 0.99)),
            "nu_zeroed_share": float(np.mean(got[nonzero] == 0)),
            "update_rel_l2_err": float(np.linalg.norm(direction_got - direction) / np.linalg.norm(direction)),
            "update_max_elem_ratio": float(np.max(np.abs(direction_got)) / np.max(np.abs(direction))),
        }
    return out


def codec_cost(rows: int = 4096, columns: int = 1024, repeats: int = 20) -> dict[str, dict[str, float]]:
    """Per codec, the median time of compressing and decompressing an adam-like ``mu`` and ``nu`` leaf
    (jitted, on this machine), in nanoseconds per element."""
    mu = 1e-3 * jax.random.normal(jax.random.PRNGKey(0), (rows, columns))
    leaves = {"mu": mu, "nu": mu**2}

    def median_ns(fn: Callable[[Any], Any], x: Any) -> float:
        fn = jax.jit(fn)
        jax.block_until_ready(fn(x))
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(x))
            seconds.append(time.perf_counter() - start)
        return float(np.median(seconds)) / (rows * columns) * 1e9

    out = {}
    for codec in CODECS:
        for name, leaf in leaves.items():
            encoded = compress(leaf, codec, jnp.int32(0))
            out[f"{codec} {name}"] = {
                "encode_ns": median_ns(lambda x, codec=codec: compress(x, codec, jnp.int32(0)), leaf),
                "decode_ns": median_ns(decompress, encoded),
            }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)

    losses, _, state = train(optax.adam(args.lr), args.steps)
    adam = state[0]
    mu, nu = ([np.asarray(x) for x in jax.tree.leaves(tree) if x.ndim >= 2] for tree in (adam.mu, adam.nu))
    result: dict[str, Any] = {"steps": args.steps, "lr": args.lr, "nu_maps": nu_errors(mu, nu)}
    result["codec_cost"] = codec_cost()
    variants = {codec: jax_mlp.quantized_state(optax.adam(args.lr), codec) for codec in CODECS}
    variants["bf16 stochastic"] = jax_mlp.quantized_state(optax.adam(args.lr), "bf16", stochastic=True)
    result["final_loss"] = {"fp32": final_loss(losses)}
    result["final_loss"].update({name: final_loss(train(tx, args.steps)[0]) for name, tx in variants.items()})
    print_and_save(result, args.out)
    return result


if __name__ == "__main__":
    main()
