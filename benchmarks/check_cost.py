"""What the optimizer check costs at ``init``, on a transformer-shaped tree (shapes only, nothing allocated).

For each optimizer it times :func:`jax_mlp.optimizer_check.check_optimizer` (the first call, as ``init``
pays it, and the median of the repeats) and, in the same run, a fresh ``jax.make_jaxpr`` of
``inner.update`` on the same tree: the check's floor, since it must trace the update once.
Writes ``check_cost.json``::

    python benchmarks/check_cost.py --layers 24 --width 1024 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from typing import Any

import jax
import numpy as np
import optax

from jax_mlp._src.errors import OffloadError
from jax_mlp._src.plan import optimizer_check

OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-3, weight_decay=0.1),
    "inject_hyperparams(adamw)": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3),
    "adafactor": lambda: optax.adafactor(1e-3),
    "lamb": lambda: optax.lamb(1e-3),
    "contrib.muon": lambda: optax.contrib.muon(1e-3),
    "chain(clip_by_global_norm, adam)": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
}


def transformer(layers: int, width: int, vocab: int) -> dict[str, Any]:
    """The param shapes of a decoder-only transformer: embeddings, per layer attention, MLP and norms."""

    def leaf(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, np.float32)

    block = {
        "attention": {name: leaf(width, width) for name in ("query", "key", "value", "out")},
        "mlp": {"up": leaf(width, 4 * width), "up_bias": leaf(4 * width), "down": leaf(4 * width, width)},
        "norm1": {"scale": leaf(width), "bias": leaf(width)},
        "norm2": {"scale": leaf(width), "bias": leaf(width)},
    }
    return {
        "embed": leaf(vocab, width),
        "layers": [block] * layers,
        "final_norm": leaf(width),
        "head": leaf(width, vocab),
    }


def _seconds(function: Any, repeats: int) -> tuple[float, float]:
    """The first call's seconds and the median over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return times[0], statistics.median(times)


def measure(name: str, params: Any, repeats: int) -> dict[str, Any]:
    inner = optax.with_extra_args_support(OPTIMIZERS[name]())
    outcome: dict[str, Any] = {}

    def check() -> None:
        try:
            outcome["whole_leaves"] = len(optimizer_check.check_optimizer(inner, params, None).whole_leaves)
        except OffloadError as error:
            outcome["refused"] = type(error).__name__

    def trace() -> None:  # a new function each time, so jax's trace cache does not answer
        jax.make_jaxpr(lambda g, s, p: inner.update(g, s, p))(params, state, params)

    state = jax.eval_shape(inner.init, params)
    first_s, check_s = _seconds(check, repeats)
    _, trace_s = _seconds(trace, repeats)
    return {
        "optimizer": name,
        "first_check_s": first_s,
        "check_s": check_s,
        "trace_s": trace_s,
        "check_over_trace": check_s / trace_s,
        **outcome,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    args = parser.parse_args(argv)
    params = transformer(args.layers, args.width, args.vocab)
    result = {
        "layers": args.layers,
        "width": args.width,
        "leaves": len(jax.tree.leaves(params)),
        "rows": [measure(name, params, args.repeats) for name in OPTIMIZERS],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "check_cost.json").write_text(json.dumps(result, indent=2))
    for row in result["rows"]:
        print(
            f"{row['optimizer']:>34}: first check {row['first_check_s']:.3f} s, check {row['check_s']:.3f} s, "
            f"trace {row['trace_s']:.3f} s"
        )
    return result


if __name__ == "__main__":
    main()
