"""Device memory of one step: the optax route (``update`` then ``apply_updates``) against the fused ``apply``.

For bf16 params with fp32 masters under adam, it samples the bytes of live jax arrays every
millisecond on a thread during each step and reports the peak minus what was live before, as a
multiple of the params' bytes (on CPU, device memory is host memory and that is the measure). All
state sits in a host cache, so no disk time enters. Prints one JSON line; ``--out`` also writes it.

    python benchmarks/device_memory.py                                  # 64 MiB of params, 8 MiB subgroups
    python benchmarks/device_memory.py --params 8MiB --subgroup-size 1MiB --write-depth 1   # the test's
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import optax

import jax_mlp

RECORDS_IN_FLIGHT = 3
"""Records the fused apply holds on the device: the subgroup computing (its fields and its results), and the one
before it while the engine's stager copies it to the host."""


class LivePeakRise:
    """Samples the bytes of live jax arrays every millisecond on a thread while in a ``with``;
    ``rise`` is the peak minus the bytes live at entry."""

    def __init__(self):
        self._done = threading.Event()
        self.rise = 0

    @staticmethod
    def live_bytes() -> int:
        return sum(x.nbytes for x in jax.live_arrays())

    def _sample(self, before: int) -> None:
        while not self._done.is_set():
            self.rise = max(self.rise, self.live_bytes() - before)
            time.sleep(0.001)

    def __enter__(self) -> LivePeakRise:
        self._thread = threading.Thread(target=self._sample, args=(self.live_bytes(),), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._done.set()
        self._thread.join()


def _params(nbytes: int) -> dict[str, jax.Array]:
    """``nbytes`` of bf16 params: one large leaf (cut into row chunks) and a small one."""
    rows = nbytes // (2 * 1024) - 4
    return {"w": jnp.ones((rows, 1024), jnp.bfloat16), "b": jnp.zeros((4096,), jnp.bfloat16)}


def measure(route: str, params_bytes: int, steps: int, **options) -> list[float]:
    """Each step's rise of live jax arrays over the params' bytes, for ``route`` "optax" or "apply"."""
    params = _params(params_bytes)
    size = sum(x.nbytes for x in jax.tree.leaves(params))
    tx = jax_mlp.mlp_offload(optax.adam(1e-3), paths=[tempfile.mkdtemp()], master_dtype=jnp.float32, **options)
    state = tx.init(params)
    rises = []
    for step in range(steps):
        grads = jax.tree.map(lambda p, s=step: (p * 0.01 + s + 1).astype(p.dtype), params)
        jax.block_until_ready(grads)
        with LivePeakRise() as peak:
            if route == "optax":
                updates, state = tx.update(grads, state, params)
                params = optax.apply_updates(params, updates)
                del updates
            else:
                params, state = tx.apply(grads, state, params)
            jax.block_until_ready(params)
        del grads
        rises.append(peak.rise / size)
    tx.close(delete=True)
    return rises


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="64MiB", help="bytes of bf16 params")
    parser.add_argument("--subgroup-size", default="8MiB")
    parser.add_argument("--write-depth", type=int, default=jax_mlp.OffloadConfig.defaults()["write_depth"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, help="a directory for device_memory.json")
    args = parser.parse_args(argv)
    params_bytes = jax_mlp.parse_size(args.params, name="--params")
    options = {
        "subgroup_size": args.subgroup_size,
        "write_depth": args.write_depth,
        "host_cache": 8 * params_bytes,  # state (12 bytes per bf16 param) stays cached
    }
    rises = {route: measure(route, params_bytes, args.steps, **options) for route in ("optax", "apply")}
    # The fused apply holds the fields of the subgroup computing, its results, and the one before it being staged
    # to the host: three records, whatever write_depth (the writes in flight hold host copies).
    records = RECORDS_IN_FLIGHT * jax_mlp.parse_size(args.subgroup_size, name="--subgroup-size")
    result = {
        "params_bytes": params_bytes,
        "subgroup_size": args.subgroup_size,
        "write_depth": args.write_depth,
        "rise_over_params": rises,
        "apply_rise_over_records_in_flight": [r * params_bytes / records for r in rises["apply"]],
    }
    print(json.dumps(result))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "device_memory.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
