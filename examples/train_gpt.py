"""Train a small character-level GPT (Flax NNX) with its AdamW state offloaded by ``jax_mlp``.

The corpus is built here, with nothing downloaded: the docstrings of a fixed list of Python
standard-library modules, read from the running interpreter (``inspect``), so it is the same on
every run with the same Python. The model learns to continue that text one character at a time.

The optimizer is ``optax.chain(optax.clip_by_global_norm(1.0), jax_mlp.mlp_offload(optax.adamw(...)))``
inside ``nnx.Optimizer``. Its AdamW state (two moments per parameter) does not stay in memory: it
lives on two storage paths (sub-directories of a temporary directory unless ``--paths`` says
otherwise) behind a host cache smaller than the state, and every update streams it through in
subgroups. The train step is split in two, because ``mlp_offload`` does I/O and so cannot run inside
``jit``:

1. the loss and gradients are computed by ``nnx.jit``;
2. ``optimizer.update(model, grads)`` runs eagerly, outside jit.

Run it with::

    python examples/train_gpt.py                 # the defaults: a few minutes on 2 CPU cores
    python examples/train_gpt.py --compare       # also train with plain optax and compare the params
    python examples/train_gpt.py --state-codec int8  # keep AdamW's moments in blockwise int8 (4x fewer bytes)
    python examples/train_gpt.py --log-to run.jsonl && jax-mlp report run.jsonl -o report.png

It exits with status 1 if the final loss is not at least 30% below the initial loss, or if
``--compare`` finds a deviation above the tolerance.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import statistics
import string
import sys
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from offload_options import add_offload_arguments, add_state_codec_argument, state_paths, with_state_codec
from tqdm import tqdm

import jax_mlp

REQUIRED_IMPROVEMENT = 0.30
TOLERANCE = 1e-5  # the exactness contract: max|Δ| / max|p| per leaf, against plain optax
LOW_PRECISION_TOLERANCE = 1e-3  # its bound for low-precision (here: compressed) state, against the same in memory
EVAL_BATCHES = 8
CORPUS_MODULES = (
    "abc",
    "argparse",
    "calendar",
    "collections",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email",
    "enum",
    "fractions",
    "functools",
    "heapq",
    "http.client",
    "inspect",
    "itertools",
    "json",
    "logging",
    "os",
    "pathlib",
    "pprint",
    "queue",
    "random",
    "re",
    "shutil",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "unittest",
    "urllib.parse",
    "zipfile",
)
VOCAB = "\n" + string.printable[:95]  # newline, then the printable ASCII characters from '0' to ' '
UNKNOWN = VOCAB.index("?")


# ----------------------------------------------------------------------------------------- data


def _docstrings(module: Any) -> Iterator[str]:
    """The docstrings of a module, its public functions and classes and their public methods, in name order."""
    yield module.__doc__ or ""
    for name, value in sorted(vars(module).items()):
        if name.startswith("_") or getattr(value, "__module__", None) != module.__name__:
            continue
        yield value.__doc__ or ""
        if inspect.isclass(value):
            for member_name, member in sorted(vars(value).items()):
                if not member_name.startswith("_") and callable(member):
                    yield member.__doc__ or ""


def build_corpus(modules: tuple[str, ...] = CORPUS_MODULES) -> str:
    """Deterministic English-and-code text: docstrings of standard-library modules of this Python.

    Args:
      modules: the modules to read.

    Returns:
      The docstrings, cleaned up (``inspect.cleandoc``) and separated by blank lines.
    """
    parts = []
    for name in modules:
        module = importlib.import_module(name)
        parts.extend(inspect.cleandoc(doc) for doc in _docstrings(module) if doc.strip())
    if not parts:
        raise RuntimeError("the standard library has no docstrings here (is Python running with -OO?)")
    return "\n\n".join(parts)


def encode(text: str) -> np.ndarray:
    """Characters to token ids over ``VOCAB``; any other character becomes ``?``."""
    lookup = np.full(0x110000, UNKNOWN, dtype=np.int32)
    lookup[[ord(c) for c in VOCAB]] = np.arange(len(VOCAB), dtype=np.int32)
    return lookup[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)]


def decode(tokens: np.ndarray) -> str:
    return "".join(VOCAB[t] for t in tokens)


class Batches:
    """Random windows of a token array: inputs and the next-character targets.

    Args:
      tokens: the token ids.
      batch_size: windows per batch.
      seq_len: characters per window.
      seed: seed of the window offsets.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int):
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"the corpus ({len(tokens)} characters) is shorter than --seq-len {seq_len}")
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self._rng = np.random.default_rng(seed)

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        starts = self._rng.integers(0, len(self.tokens) - self.seq_len - 1, self.batch_size)
        windows = self.tokens[starts[:, None] + np.arange(self.seq_len + 1)]
        return windows[:, :-1], windows[:, 1:]


# ----------------------------------------------------------------------------------------- model


class Attention(nnx.Module):
    """Causal multi-head self-attention."""

    def __init__(self, d_model: int, heads: int, *, rngs: nnx.Rngs):
        if d_model % heads:
            raise ValueError(f"--d-model {d_model} must be a multiple of --heads {heads}")
        self.heads = heads
        self.qkv = nnx.Linear(d_model, 3 * d_model, rngs=rngs)
        self.out = nnx.Linear(d_model, d_model, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, width = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(batch, length, 3 * self.heads, width // self.heads), 3, axis=2)
        return self.out(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(batch, length, width))


class Block(nnx.Module):
    """A pre-norm transformer block: attention, then a GELU MLP, each with a residual connection."""

    def __init__(self, d_model: int, heads: int, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(d_model, rngs=rngs)
        self.attention = Attention(d_model, heads, rngs=rngs)
        self.norm2 = nnx.LayerNorm(d_model, rngs=rngs)
        self.up = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
        self.down = nnx.Linear(4 * d_model, d_model, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attention(self.norm1(x))
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class GPT(nnx.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm and a linear head."""

    def __init__(self, vocab: int, seq_len: int, d_model: int, layers: int, heads: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
        self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, d_model)))
        self.blocks = nnx.List([Block(d_model, heads, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def cross_entropy(model: GPT, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    logits = model(inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@nnx.jit
def loss_and_grads(model: GPT, inputs: jax.Array, targets: jax.Array) -> tuple[jax.Array, nnx.State]:
    """The jitted half of the train step; the optimizer update runs outside jit."""
    return nnx.value_and_grad(cross_entropy)(model, inputs, targets)


@nnx.jit
def reference_update(optimizer: nnx.Optimizer, model: GPT, grads: nnx.State) -> None:
    """The in-memory optax update of ``--compare``, jitted as usual, on the offloaded run's grads."""
    optimizer.update(model, grads)


eval_loss = nnx.jit(cross_entropy)


def evaluate(model: GPT, batches: list[tuple[np.ndarray, np.ndarray]]) -> float:
    return float(np.mean([eval_loss(model, x, y) for x, y in batches]))


def sample(model: GPT, prompt: str, length: int, seq_len: int, seed: int) -> str:
    """A continuation of ``prompt``, drawn one character at a time at temperature 0.8 (seeded)."""
    forward = nnx.jit(lambda m, x: m(x))
    key = jax.random.key(seed)
    tokens = list(encode(prompt))
    for i in range(length):
        context = tokens[-seq_len:]
        window = np.full((1, seq_len), VOCAB.index(" "), dtype=np.int32)
        window[0, : len(context)] = context
        logits = forward(model, window)[0, len(context) - 1]
        tokens.append(int(jax.random.categorical(jax.random.fold_in(key, i), logits / 0.8)))
    return decode(np.asarray(tokens[len(prompt) :]))


# ----------------------------------------------------------------------------------------- training


class Run(NamedTuple):
    """What a training run produced."""

    model: GPT
    reference: GPT | None
    initial_loss: float
    final_loss: float
    train_losses: list[float]
    update_seconds: list[float]
    seconds: float


def _progress(loss: float, seconds: float, tokens: int, stats: jax_mlp.UpdateStats) -> dict[str, str]:
    """The progress bar's fields; a path's throughput is the bytes it moved over the update's wall time."""
    fields = {"loss": f"{loss:.3f}", "tok/s": f"{tokens / seconds:,.0f}", "update": f"{stats.seconds * 1e3:.0f}ms"}
    for i, path in enumerate(stats.paths):
        moved = stats.bytes_read[path] + stats.bytes_written[path]
        fields[f"p{i}"] = f"{moved / max(stats.seconds, 1e-9) / 1e6:.0f}MB/s"
    return fields


def train(args: argparse.Namespace, tokens: np.ndarray, offload: jax_mlp.OffloadTransformation) -> Run:
    """Trains a fresh GPT on ``tokens`` with ``offload`` (and, with ``--compare``, plain optax alongside).

    The step is split: ``loss_and_grads`` runs under ``nnx.jit``, then ``optimizer.update`` runs
    eagerly, so the update streams the state through the device (traced inside jit it would run on
    the host CPU instead: see docs/usage.md, "Which route runs where"). With ``--compare`` a second,
    identically initialised model takes the same gradients through in-memory optax: training is
    chaotic, so two free-running models drift apart from rounding alone, and giving both optimizers
    the same gradients isolates what they compute.

    Args:
      args: the parsed flags.
      tokens: the corpus as token ids.
      offload: the ``mlp_offload`` transformation to train with.

    Returns:
      The trained model (and reference model), its losses and timings.
    """
    split = int(0.9 * len(tokens))
    train_batches = Batches(tokens[:split], args.batch_size, args.seq_len, args.seed)
    eval_source = Batches(tokens[split:], args.batch_size, args.seq_len, args.seed + 1)
    eval_batches = [eval_source.next() for _ in range(EVAL_BATCHES)]

    def new_model() -> GPT:
        return GPT(len(VOCAB), args.seq_len, args.d_model, args.layers, args.heads, rngs=nnx.Rngs(args.seed))

    model = new_model()
    # Global transformations such as clipping go before mlp_offload, which sees one subgroup at a time.
    optimizer = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0), offload), wrt=nnx.Param)
    reference = new_model() if args.compare else None
    if reference is not None:
        reference_tx = optax.chain(optax.clip_by_global_norm(1.0), make_optimizer(args))
        reference_optimizer = nnx.Optimizer(reference, reference_tx, wrt=nnx.Param)
    initial_loss = evaluate(model, eval_batches)
    train_losses, update_seconds = [], []
    start = time.perf_counter()
    with tqdm(range(1, args.steps + 1), desc="train", unit="step", disable=None, dynamic_ncols=True) as bar:
        for step in bar:
            tick = time.perf_counter()
            inputs, targets = train_batches.next()
            loss, grads = loss_and_grads(model, inputs, targets)  # in jit
            optimizer.update(model, grads)  # eager: streams the AdamW state through the device
            if reference is not None:
                reference_update(reference_optimizer, reference, grads)
            train_losses.append(float(loss))
            update_seconds.append(offload.stats.seconds)
            fields = _progress(train_losses[-1], time.perf_counter() - tick, inputs.size, offload.stats)
            bar.set_postfix(fields, refresh=False)
            if step % args.log_every == 0 or step == args.steps:
                bar.write(f"step {step:5d}  " + "  ".join(f"{k} {v}" for k, v in fields.items()))
    seconds = time.perf_counter() - start
    return Run(model, reference, initial_loss, evaluate(model, eval_batches), train_losses, update_seconds, seconds)


def make_adamw(args: argparse.Namespace) -> optax.GradientTransformation:
    """AdamW with a linear warm-up, a cosine decay, and weight decay on matrices only (not biases or norms)."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(100, args.steps // 10 + 1), args.steps, args.lr / 10
    )
    return optax.adamw(
        schedule, b2=0.99, weight_decay=0.1, mask=lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
    )


def make_optimizer(args: argparse.Namespace) -> optax.GradientTransformation:
    """AdamW, with its moments kept as ``--state-codec`` says (the offloaded and the ``--compare`` run alike)."""
    return with_state_codec(make_adamw(args), args.state_codec)


def tolerance(args: argparse.Namespace) -> float:
    """The exactness contract's bound for ``--compare``: looser for compressed (low-precision) state."""
    return TOLERANCE if args.state_codec == "none" else LOW_PRECISION_TOLERANCE


def max_deviation(actual: GPT, expected: GPT) -> tuple[float, str]:
    """The largest per-leaf ``max|Δ| / max|p|`` between two models' params, and that leaf's path."""
    worst, where = 0.0, ""
    expected_leaves = jax.tree_util.tree_leaves(nnx.state(expected, nnx.Param))
    for (path, a), e in zip(
        jax.tree_util.tree_flatten_with_path(nnx.state(actual, nnx.Param))[0], expected_leaves, strict=True
    ):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        deviation = float(np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-30))
        if deviation >= worst:
            worst, where = deviation, jax.tree_util.keystr(path)
    return worst, where


# ----------------------------------------------------------------------------------------- command line


def add_model_arguments(parser: argparse.ArgumentParser, *, context: str) -> None:
    """Adds the GPT's shape: ``--layers``, ``--d-model``, ``--heads`` and ``--seq-len`` (``context`` names its unit).

    ``pretrain.py`` trains the same GPT, so it takes these too.
    """
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--d-model", type=int, default=128, help="width of the residual stream")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--seq-len", type=int, default=64, help=f"{context} of context")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_offload_arguments(parser, steps=500, host_cache="2MiB", subgroup_size="512KiB")
    add_state_codec_argument(parser)
    add_model_arguments(parser, context="characters")
    parser.add_argument("--batch-size", type=int, default=32, help="windows per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model's init and the batches")
    parser.add_argument("--log-to", default=None, help="write one JSON line of offload telemetry per update here")
    parser.add_argument("--log-every", type=int, default=50, help="print a progress line every this many steps")
    parser.add_argument("--sample", type=int, default=200, help="characters to generate at the end (0: none)")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also update an identically initialised model with plain in-memory optax on the same gradients, "
        f"and check that the final params agree within max|Δ|/max|p| <= {TOLERANCE:g} per leaf "
        f"({LOW_PRECISION_TOLERANCE:g} with a --state-codec)",
    )
    args = parser.parse_args(argv)
    for name in ("steps", "layers", "d_model", "heads", "seq_len", "batch_size", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


class Offloaded(NamedTuple):
    """A finished run, with the offload's last stats and its plan (read before the offload closed)."""

    run: Run
    stats: jax_mlp.UpdateStats
    plan: jax_mlp.Plan


def train_offloaded(args: argparse.Namespace, tokens: np.ndarray) -> Offloaded:
    """Trains with the AdamW state on ``--paths`` (or temporary ones, deleted at the end)."""
    with state_paths(args.paths, count=2, prefix="jax_mlp_gpt_") as (paths, temporary):
        offload = jax_mlp.mlp_offload(
            make_optimizer(args),
            paths=paths,
            host_cache=args.host_cache,
            subgroup_size=args.subgroup_size,
            log_to=args.log_to,
        )
        try:
            return Offloaded(train(args, tokens, offload), offload.stats, offload.plan)
        finally:
            offload.close(delete=temporary)


def print_summary(args: argparse.Namespace, corpus_chars: int, offloaded: Offloaded, tokens_per_s: float) -> None:
    """Prints the run: corpus, model and state sizes, speed, eval losses, the last update's stats, a sample."""
    run, plan = offloaded.run, offloaded.plan
    num_params = sum(leaf.size for leaf in jax.tree_util.tree_leaves(nnx.state(run.model, nnx.Param)))
    print()
    print(
        f"corpus: {corpus_chars:,} characters of standard-library docstrings; model: {num_params:,} params; "
        f"AdamW state ({args.state_codec} codec) {jax_mlp.format_bytes(plan.state_nbytes)} in {len(plan.subgroups)} subgroups "
        f"behind a {args.host_cache} host cache"
    )
    print(
        f"trained {args.steps} steps in {run.seconds:.1f} s ({tokens_per_s:,.0f} tokens/s); optimizer update: "
        f"median {statistics.median(run.update_seconds) * 1e3:.1f} ms"
    )
    print(f"initial eval loss  {run.initial_loss:.4f}")
    print(f"final eval loss    {run.final_loss:.4f}  ({(1 - run.final_loss / run.initial_loss) * 100:.1f}% lower)")
    print("offload stats of the last update:")
    print(offloaded.stats.summary())
    if args.sample:
        prompt = "Return the "
        print(f"sample: {prompt + sample(run.model, prompt, args.sample, args.seq_len, args.seed)!r}")


def compare(args: argparse.Namespace, run: Run) -> dict[str, Any]:
    """Checks the offloaded model against the ``--compare`` reference; prints and returns the verdict."""
    deviation, leaf = max_deviation(run.model, run.reference)
    passed = deviation <= tolerance(args)
    print(
        f"compare with plain optax on the same gradients over {args.steps} steps: largest deviation "
        f"max|Δ|/max|p| = {deviation:.2e} (leaf {leaf}), "
        f"tolerance {tolerance(args):g}: {'PASS' if passed else 'FAIL'}"
    )
    return {"deviation": deviation, "deviation_leaf": leaf, "compare_passed": passed}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Trains the GPT with offloaded AdamW state (and, with ``--compare``, with plain optax too).

    Args:
      argv: the command-line arguments; None reads ``sys.argv``.

    Returns:
      ``initial_loss`` and ``final_loss`` (eval), ``train_losses``, ``stats`` (the last update's
      ``UpdateStats.as_dict()``), ``seconds``, ``tokens_per_s``, and with ``--compare`` also
      ``deviation``, ``deviation_leaf`` and ``compare_passed``.
    """
    args = parse_args(argv)
    tokens = encode(build_corpus())
    offloaded = train_offloaded(args, tokens)
    run = offloaded.run
    tokens_per_s = args.steps * args.batch_size * args.seq_len / run.seconds
    print_summary(args, len(tokens), offloaded, tokens_per_s)
    result = {
        "initial_loss": run.initial_loss,
        "final_loss": run.final_loss,
        "train_losses": run.train_losses,
        "stats": offloaded.stats.as_dict(),
        "seconds": run.seconds,
        "tokens_per_s": tokens_per_s,
        "state_codec": args.state_codec,
    }
    if run.reference is not None:
        result.update(compare(args, run))
    return result


def _cli() -> int:
    result = main()
    failed = False
    if not result["final_loss"] <= (1 - REQUIRED_IMPROVEMENT) * result["initial_loss"]:
        print(
            f"FAILED: the final loss {result['final_loss']:.4f} is not at least {REQUIRED_IMPROVEMENT:.0%} below "
            f"the initial loss {result['initial_loss']:.4f}",
            file=sys.stderr,
        )
        failed = True
    if not result.get("compare_passed", True):
        print("FAILED: the offloaded run deviates from plain optax by more than the tolerance", file=sys.stderr)
        failed = True
    return int(failed)


if __name__ == "__main__":
    sys.exit(_cli())
