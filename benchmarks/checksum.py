"""The record checksum: CRC throughput per library, and the CPU seconds of an uncached update.

- Throughput: best of 5 on one 64 MiB buffer, for zlib's CRC-32, ISA-L's (the same checksum, what
  records use) and, when installed, the hardware CRC32C packages ``crc32c`` and ``google-crc32c``.
- Update cost: adam over a 256 MiB state with ``host_cache=0`` and no idle-time reads ahead (every
  record verified on read and sealed on write, none taken from memory), ``time.process_time`` per update, ``--updates`` per round, each round a fresh
  offload; the bytes it checksums are its ``bytes_read`` and ``bytes_written`` (``tx.stats``).
- What the checksums cost of that update with each library: those bytes at its throughput.

The checksum records use is ISA-L's, a core dependency (docs/usage.md); the public API offers no way
to swap it, so the update is timed with it alone, and the other libraries' cost in its place is
estimated from the throughputs (an earlier version swapped a private hook for zlib's: the measured
difference, 0.20 CPU s per update, matched that estimate, 0.21 s; docs/efficiency.md#checksum).

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


def update_cpu_seconds(state_bytes: int, updates: int) -> tuple[float, int]:
    """CPU seconds (all threads) per uncached adam update over ``state_bytes`` of state, and the bytes it checksums."""
    n = state_bytes // 8
    params = {"w": jnp.ones((n // 1024, 1024), jnp.float32)}
    grads = jax.tree.map(lambda p: p * 0.01, params)
    with tempfile.TemporaryDirectory(dir=".") as directory:
        tx = jax_mlp.mlp_offload(
            optax.adam(1e-3), paths=[directory], host_cache=0, idle_prefetch=False, subgroup_size="16MiB"
        )
        state = tx.init(params)
        _, state = tx.update(grads, state, params)  # compiles
        start = time.process_time()
        for _ in range(updates):
            new, state = tx.update(grads, state, params)
            jax.block_until_ready(new)
        seconds = (time.process_time() - start) / updates
        checksummed = sum(tx.stats.bytes_read.values()) + sum(tx.stats.bytes_written.values())
        tx.close(delete=True)
    return seconds, checksummed


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--buffer", default="64MiB", help="bytes checksummed per throughput measurement")
    parser.add_argument("--state", default="256MiB", help="adam state of the update measurement")
    parser.add_argument("--updates", type=int, default=3, help="updates timed per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each on a fresh offload")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)

    rounds = [update_cpu_seconds(jax_mlp.parse_size(args.state), args.updates) for _ in range(args.rounds)]
    cpu = [seconds for seconds, _ in rounds]
    checksummed = rounds[-1][1]
    speeds = throughputs(jax_mlp.parse_size(args.buffer))
    result = {
        "gb_per_s": speeds,
        "update_cpu_s": {"median": statistics.median(cpu), "all": cpu},
        "checksummed_bytes": checksummed,
        "checksum_cpu_s": {name: checksummed / (gb_per_s * 1e9) for name, gb_per_s in speeds.items()},
        "state": args.state,
    }
    print_and_save(result, args.out)
    return result


if __name__ == "__main__":
    main()
