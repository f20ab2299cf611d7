"""What the optimizer check costs at ``init``, on a transformer-shaped tree (shapes only, nothing allocated).

For each optimizer it times ``plan_for`` of a fresh ``mlp_offload`` (the optimizer check,
then the plan of the subgroups, as ``init`` pays them; the first call, and the median of the repeats)
and, in the same run, a fresh ``jax.make_jaxpr`` of ``inner.update`` on the same tree: the check's
floor, since it must trace the update once. The check itself is private; its public face is
``plan_for`` and the ``check_s`` of the init's stats, so it is timed through the first (the plan
adds little: a profile puts about 90% of the time in JAX's tracing). ``whole_leaves`` counts the
leaves the plan keeps whole although their state exceeds ``--subgroup-size`` (what the init's
``stats.whole_leaf_subgroups`` lists): leaves whose optimizer mixes their rows. Writes
``check_cost.json``::

    python benchmarks/check_cost.py --layers 24 --width 1024 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
import warnings
from typing import Any

import jax
import numpy as np
import optax

import jax_mlp

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


def kept_whole(plan: jax_mlp.Plan, subgroup_size: int) -> list[str]:
    """The leaves a plan keeps in one piece although their state (and master) exceeds ``subgroup_size``."""
    return [
        plan.leaves[sg.pieces[0].leaf].path
        for sg in plan.subgroups
        if len(sg.pieces) == 1 and sg.pieces[0].rows is None and sg.layout.nbytes > subgroup_size
    ]


def measure(name: str, params: Any, repeats: int, subgroup_size: int) -> dict[str, Any]:
    inner = OPTIMIZERS[name]()
    outcome: dict[str, Any] = {}

    def check() -> None:  # a fresh offload each time: plan_for keeps the plan of the params it saw last
        offload = jax_mlp.mlp_offload(inner, paths=["unused"], subgroup_size=subgroup_size)
        try:
            with warnings.catch_warnings():  # plan_for warns of each leaf kept whole above the subgroup size
                warnings.simplefilter("ignore")
                outcome["whole_leaves"] = len(kept_whole(offload.plan_for(params), subgroup_size))
        except jax_mlp.OffloadError as error:
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
    parser.add_argument(
        "--subgroup-size", default=jax_mlp.OffloadConfig.defaults()["subgroup_size"], help="subgroup_size of the plan"
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    args = parser.parse_args(argv)
    params = transformer(args.layers, args.width, args.vocab)
    subgroup_size = jax_mlp.parse_size(args.subgroup_size, name="--subgroup-size")
    result = {
        "layers": args.layers,
        "width": args.width,
        "leaves": len(jax.tree.leaves(params)),
        "subgroup_size": subgroup_size,
        "rows": [measure(name, params, args.repeats, subgroup_size) for name in OPTIMIZERS],
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
