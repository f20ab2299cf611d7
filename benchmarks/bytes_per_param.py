"""Bytes moved per param by one adam update, read from the stats, for each way of storing the state.

Rows: fp32 params; bf16 params with fp32 masters stored whole (``master_storage="full"``, the default) or as
their low 16 bits (``"remainder"``); each with adam's moments exact, in bf16 and in
int8 (``quantized_state``). With no host cache and no reads ahead every record is read and written once
per update, so the figures are the bytes a disk must move per param: what bounds an update that waits on
I/O.

    PYTHONPATH=. python benchmarks/bytes_per_param.py --out benchmarks/results/bytes_per_param.json
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import optax
from common import print_and_save

import jax_mlp

PARAMS = {
    "fp32": (jnp.float32, None, "full"),
    "bf16 + fp32 master, full": (jnp.bfloat16, jnp.float32, "full"),
    "bf16 + fp32 master, remainder": (jnp.bfloat16, jnp.float32, "remainder"),
}
CODECS = ("none", *jax_mlp.quantized.CODECS)


def _inner(codec: str) -> optax.GradientTransformation:
    adam = optax.adam(1e-3)
    return adam if codec == "none" else jax_mlp.quantized_state(adam, codec)


def _grads(params: Any, step: int) -> Any:
    return jax.tree.map(lambda p: jnp.sin(p.astype(jnp.float32) * (step + 1.3)).astype(p.dtype), params)


def measure(params: Any, codec: str, directory: pathlib.Path, **options: Any) -> dict[str, float]:
    """Bytes read and written per update (no host cache), and the plan's record bytes, per param.

    Averaged over the second and third updates, one period of the alternating order: each update's last
    ``write_depth`` writes run on past it and are counted by the next. With no idle-time reads ahead, an
    update reads every record itself, none of them from memory.
    """
    tx = jax_mlp.mlp_offload(
        _inner(codec), paths=[directory], subgroup_size="256KiB", host_cache=0, idle_prefetch=False, **options
    )
    state, moved = tx.init(params), []
    for step in range(3):
        _, state = tx.update(_grads(params, step), state, params)
        moved.append((sum(tx.stats.bytes_read.values()), sum(tx.stats.bytes_written.values())))
    count = sum(x.size for x in jax.tree.leaves(params))
    result = {
        "read_per_param": sum(read for read, _ in moved[1:]) / 2 / count,
        "written_per_param": sum(written for _, written in moved[1:]) / 2 / count,
        "stored_per_param": tx.plan.state_nbytes / count,
    }
    tx.close(delete=True)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=512, help="rows of each of the two (rows, 256) leaves")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    base = {name: 0.5 * jax.random.normal(k, (args.rows, 256)) for name, k in zip("ab", keys, strict=True)}
    rows = []
    with tempfile.TemporaryDirectory(prefix="jax_mlp_bytes_") as root:
        for label, (dtype, master, storage) in PARAMS.items():
            params = jax.tree.map(lambda x, d=dtype: x.astype(d), base)
            for codec in CODECS:
                directory = pathlib.Path(root) / f"{len(rows)}"
                figures = measure(params, codec, directory, master_dtype=master, master_storage=storage)
                rows.append({"params": label, "codec": codec, **{k: round(v, 3) for k, v in figures.items()}})
    result = {"bytes_per_param": rows, "params": 2 * args.rows * 256}
    print_and_save(result, args.out)
    return result


if __name__ == "__main__":
    main()
