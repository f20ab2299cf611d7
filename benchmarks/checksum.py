"""The record checksum: CRC throughput per library, and the CPU seconds of an uncached update with each.

- Throughput: best of 5 on one 64 MiB buffer, for zlib's CRC-32, ISA-L's (the same checksum, what
  records use) and, when installed, the hardware CRC32C packages ``crc32c`` and ``google-crc32c``.
- Update cost: adam over a 256 MiB state with ``host_cache=0`` (every record verified on read and
  sealed on write), ``time.process_time`` per update with ``record.crc32`` set to zlib's, then to
  ISA-L's, alternating for ``--rounds`` rounds in the same run.

    PYTHONPATH=. python benchmarks/checksum.py --out benchmarks/results/checksum.json
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import print_and_save
from isal.isal_zlib import crc32 as isal_crc32

import jax_mlp
from jax_mlp._src.storage import record


def _optional(module: str, attribute: str, *, read_only: bool = False) -> Callable[[np.ndarray], int] | None:
    try:
        function = getattr(importlib.import_module(module), attribute)
    except ImportError:
        return None
    if not read_only:
        return function

    def on_read_only_view(data: np.ndarray) -> int:  # google-crc32c takes read-only buffers only
        view = data.view()
        view.flags.writeable = False
        return function(view)

    return on_read_only_view


def throughputs(nbytes: int) -> dict[str, float]:
    """GB/s of each CRC on ``nbytes`` of random data, best of 5."""
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    functions = {
        "zlib.crc32": zlib.crc32,
        "isal.isal_zlib.crc32": isal_crc32,
        "crc32c.crc32c": _optional("crc32c", "crc32c"),
        "google_crc32c.value": _optional("google_crc32c", "value", read_only=True),
    }
    out = {}
    for name, function in functions.items():
        if function is None:
            continue
        function(data)
        best = min(_seconds(lambda f=function: f(data)) for _ in range(5))
        out[name] = nbytes / best / 1e9
    return out


def _seconds(work: Callable[[], Any]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def update_cpu_seconds(state_bytes: int, updates: int, crc: Callable) -> float:
    """CPU seconds (all threads) per uncached adam update over ``state_bytes`` of state, sealing with ``crc``."""
    record.crc32 = crc
    n = state_bytes // 8
    params = {"w": jnp.ones((n // 1024, 1024), jnp.float32)}
    grads = jax.tree.map(lambda p: p * 0.01, params)
    with tempfile.TemporaryDirectory(dir=".") as directory:
        tx = jax_mlp.mlp_offload(optax.adam(1e-3), paths=[directory], host_cache=0, subgroup_size="16MiB")
        state = tx.init(params)
        _, state = tx.update(grads, state, params)  # compiles
        start = time.process_time()
        for _ in range(updates):
            new, state = tx.update(grads, state, params)
            jax.block_until_ready(new)
        seconds = (time.process_time() - start) / updates
        tx.close(delete=True)
    return seconds


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--buffer", default="64MiB", help="bytes checksummed per throughput measurement")
    parser.add_argument("--state", default="256MiB", help="adam state of the update measurement")
    parser.add_argument("--updates", type=int, default=3, help="updates timed per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, alternating zlib and ISA-L")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)

    used = record.crc32
    cpu: dict[str, list[float]] = {"zlib": [], "isal": []}
    try:
        for _ in range(args.rounds):
            for name, crc in (("zlib", zlib.crc32), ("isal", isal_crc32)):
                cpu[name].append(update_cpu_seconds(jax_mlp.parse_size(args.state), args.updates, crc))
    finally:
        record.crc32 = used
    result = {
        "gb_per_s": throughputs(jax_mlp.parse_size(args.buffer)),
        "update_cpu_s": {name: {"median": statistics.median(v), "all": v} for name, v in cpu.items()},
        "state": args.state,
    }
    result["update_cpu_ratio_isal_over_zlib"] = (
        result["update_cpu_s"]["isal"]["median"] / (result["update_cpu_s"]["zlib"]["median"])
    )
    print_and_save(result, args.out)
    return result


if __name__ == "__main__":
    main()
