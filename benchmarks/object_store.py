"""An offloaded update on an object store against the server's raw throughput, measured in the same run.

For each server (moto's S3 server and fake-gcs-server, started here on 127.0.0.1; see
``tests/object_stores.py``), in one process:

1. the raw throughput of the store for the bytes of one update, as ``jax-mlp probe --json`` measures
   it through the tier code the offloader uses (the same tensorstore spec and context): the update's
   bytes in records of its size, written, read, and read while writing as many, every record in
   flight (tensorstore's own request limit, 32, bounds the requests); one probe before every update,
   so the server is measured under the same conditions;
2. the time of ``mlp_offload(optax.adam, host_cache=0, idle_prefetch=False)`` updates on that store
   alone, each followed by ``flush()``: an update's last ``write_depth`` writes run on past it, and the
   flush waits for them, so the time covers every record of the step read and written once;
3. the I/O bound of each update, ``bytes_read / raw_read + bytes_written / raw_write`` (every record,
   header included, each way), and the bound
   from reading and writing at once, ``max(r, w) + serial * min(r, w)`` of those two times with the
   probe's ``serial`` (docs/scheduling.md); and the ratio of the update to each;
4. an outage: a small offload with the default ``store_timeout``, the server killed between two
   updates, and the seconds until the next update fails (with the error's first words).

The ratio is what carries over to a real bucket; the absolute figures are those of a Python (moto)
or Go (fake-gcs) server on this machine's two cores, which the update's own compute shares.

Writes ``object_store.json`` into ``--out``.

    python benchmarks/object_store.py --out benchmarks/results
    python benchmarks/object_store.py --smoke --out /tmp/store   # seconds, for tests (store_timeout=2 there)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import optax
from common import RECORD_HEADER, jax_mlp_json, parse_with_smoke, print_and_save

import jax_mlp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from object_stores import S3_KEYS, FakeGcs, MotoS3  # the servers the tests use

SMOKE = {"state": "8MiB", "subgroup_size": "2MiB", "updates": 1}
SERVERS = ("s3", "gcs")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state", default="512MiB", help="adam state of the offloaded update (2x the fp32 params)")
    parser.add_argument("--subgroup-size", default=None, help="subgroup_size (default: mlp_offload's)")
    parser.add_argument("--updates", type=int, default=3, help="measured updates (after one warm-up)")
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--out", default="benchmarks/results", help="output folder for the JSON")
    return parse_with_smoke(parser, argv, SMOKE)


def make_params(state_bytes: int, subgroup_bytes: int) -> dict:
    """Random fp32 params whose adam state is ``state_bytes``, in leaves of half a subgroup's params."""
    columns = 1024
    rows = max(1, subgroup_bytes // (2 * 4 * columns * 2))
    count = max(1, state_bytes // (8 * rows * columns))
    keys = jax.random.split(jax.random.key(0), count)
    return {f"w{i:04d}": jax.random.normal(keys[i], (rows, columns), jnp.float32) for i in range(count)}


def raw_round(spec: dict, record_bytes: list[int]) -> dict[str, float]:
    """``jax-mlp probe`` of the store for the records' bytes, every record in flight: bytes/s each way, and ``serial``."""
    store = json.dumps({**spec, "path": spec["path"] + "raw/"})
    sizes = ["--size", str(sum(record_bytes)), "--record", str(max(record_bytes)), "--inflight", str(len(record_bytes))]
    (measured,) = jax_mlp_json("probe", store, *sizes)
    return measured


def measure(name: str, spec: dict, args: argparse.Namespace) -> dict:
    """The raw rounds and the updates on one store, and their ratios."""
    options = {} if args.subgroup_size is None else {"subgroup_size": args.subgroup_size}
    config = jax_mlp.OffloadConfig(paths=[spec], **options)
    params = make_params(jax_mlp.parse_size(args.state), config.subgroup_size)
    path = jax_mlp.Path({**spec, "path": spec["path"] + "run/"})
    tx = jax_mlp.mlp_offload(optax.adam(1e-3), paths=[path], host_cache=0, idle_prefetch=False, **options)
    state = tx.init(params)
    records = [sg.layout.nbytes for sg in tx.plan.subgroups]
    moved = sum(RECORD_HEADER + nbytes for nbytes in records)  # each way, once per update
    rows = []
    for step in range(args.updates + 1):
        raw = raw_round(spec, records)
        grads = jax.block_until_ready(jax.tree.map(lambda p, step=step: p * 0.01 + step, params))
        start = time.perf_counter()
        updates, state = tx.update(grads, state, params)
        jax.block_until_ready(updates)
        tx.flush()
        seconds = time.perf_counter() - start
        stats = tx.stats
        read, written = moved, moved
        read_s, write_s = read / raw["read_bandwidth"], written / raw["write_bandwidth"]
        bound = read_s + write_s
        both = max(read_s, write_s) + raw["serial"] * min(read_s, write_s)
        rows.append(
            {
                "step": step,
                "update_s": seconds,
                "read_wait_s": stats.read_wait_s,
                "write_wait_s": stats.write_wait_s,
                "compute_s": stats.compute_s,
                "bytes_read": read,
                "bytes_written": written,
                "raw_read_MBps": raw["read_bandwidth"] / 1e6,
                "raw_write_MBps": raw["write_bandwidth"] / 1e6,
                "raw_serial": raw["serial"],
                "io_bound_s": bound,
                "io_bound_at_once_s": both,
                "ratio_to_io_bound": seconds / bound,
                "ratio_to_io_bound_at_once": seconds / both,
            }
        )
        del updates, grads
    tx.close(delete=True)
    measured = rows[1:]  # the first update compiles
    return {
        "server": name,
        "records": len(records),
        "record_bytes": max(records),
        "state_bytes": tx.plan.state_nbytes,
        "median_ratio_to_io_bound": statistics.median(r["ratio_to_io_bound"] for r in measured),
        "median_ratio_to_io_bound_at_once": statistics.median(r["ratio_to_io_bound_at_once"] for r in measured),
        "updates": rows,
    }


def outage(server: MotoS3 | FakeGcs, spec: dict, store_timeout: float | None) -> dict:
    """Seconds from killing ``server`` between two updates to the next update's failure; the server is restarted."""
    options = {} if store_timeout is None else {"store_timeout": store_timeout}
    config = jax_mlp.OffloadConfig(paths=[spec], **options)
    params = {f"w{i}": jnp.full((64, 256), float(i)) for i in range(8)}
    tx = jax_mlp.mlp_offload(
        optax.adam(1e-3), paths=[{**spec, "path": spec["path"] + "outage/"}], subgroup_size="128KiB", **options
    )
    state = tx.init(params)
    for step in range(2):
        _, state = tx.update(jax.tree.map(lambda p, step=step: p * 0.0 + step, params), state, params)
    server.kill()
    start = time.perf_counter()
    try:
        tx.update(params, state, params)
        error = "none: the update succeeded"
    except jax_mlp.OffloadError as failure:
        error = f"{type(failure).__name__}: {str(failure)[:160]}"
    seconds = time.perf_counter() - start
    server.start()
    if isinstance(server, MotoS3):
        server.create_bucket(spec["bucket"])  # moto keeps nothing across a restart
    tx.close(delete=True)
    return {
        "store_timeout": config.store_timeout,
        "io_timeout": config.io_timeout,
        "failed_after_s": seconds,
        "error": error,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "what": "one offloaded adam update and its flush on an object store (host_cache=0, idle_prefetch=False) "
        "against the raw throughput of the same store for the same records, measured before each update in the same run",
        "state": args.state,
        "servers": [],
    }
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.servers:
            if name == "s3":
                server = MotoS3().start()
                os.environ.update({k: os.environ.get(k, v) for k, v in S3_KEYS.items()})
                server.create_bucket("bench")
                spec = server.spec("bench", "offload/")
            else:
                server = FakeGcs(pathlib.Path(scratch) / "gcs").start()
                os.environ.update(server.environ())
                server.create_bucket("bench")
                spec = {"driver": "gcs", "bucket": "bench", "path": "offload/"}
            try:
                row = measure(name, spec, args)
                row["outage"] = outage(server, spec, 2.0 if args.smoke else None)
                results["servers"].append(row)
            finally:
                server.stop()
    print_and_save(results, out / "object_store.json")
    return results


if __name__ == "__main__":
    main()
