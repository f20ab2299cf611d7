"""``jax-mlp probe``: each path's read and write bandwidth through the tier code training uses, and its room."""

from __future__ import annotations

import argparse
import json

from jax_mlp._src.cli.command import DEFAULTS, Command, argument
from jax_mlp._src.cli.speeds import (
    DUPLEX,
    PROBE_INFLIGHT,
    PROBE_RECORD,
    PROBE_SIZE,
    is_store,
    path_needs,
    probe_location,
    record_sizes,
)
from jax_mlp._src.parsing import format_bytes, parse_size
from jax_mlp._src.schedule.performance import measured_speed
from jax_mlp._src.storage import capacity, local


def handle(args: argparse.Namespace) -> int:
    """``jax-mlp probe``: measures each path's bandwidth through the tier code, and its free space."""
    total, record = parse_size(args.size, name="--size"), parse_size(args.record, name="--record")
    results = [probe_location(location, total, record, args.inflight) for location in args.paths]
    rooms = [None if is_store(location) else local.room(location) for location in args.paths]
    needs = None
    if args.state is not None:
        records = record_sizes(
            parse_size(args.state, name="--state"), parse_size(args.subgroup_size, name="--subgroup-size")
        )
        blocks = [capacity.BLOCK if room is None else room.block for room in rooms]
        needs = path_needs([measured_speed(r) for r in results], records, blocks)
    if args.json:  # one object per path: the measurement, its free space (None for a store) and its need
        frees = [None if room is None else room.free for room in rooms]
        rows = [
            {**r._asdict(), "free": free, "needs": needs[i] if needs else None}
            for i, (r, free) in enumerate(zip(results, frees, strict=True))
        ]
        print(json.dumps(rows, indent=1))
        return 0
    print(
        f"{'path':<40} {'read':>12} {'write':>12} {'both at once':>14} {'free':>12}"
        + (f" {'needs':>12}" if needs else "")
    )
    for index, (result, room) in enumerate(zip(results, rooms, strict=True)):
        line = f"{result.path:<40} {result.read_bandwidth / 1e6:>9.0f} MB/s {result.write_bandwidth / 1e6:>9.0f} MB/s"
        line += f" {_together(result.serial):>14} {'-' if room is None else format_bytes(room.free):>12}"
        if needs:
            short = room is not None and needs[index] > room.free
            line += f" {format_bytes(needs[index]):>12}" + ("  (short)" if short else "")
        print(line)
    print(
        "(both at once: how reading and writing together compare with each alone; duplex paths do both at full speed)"
    )
    if needs:
        print(f"(needs: two slots of each record of its share of {args.state}, plus {capacity.HEADROOM:.0%} headroom)")
    if None in rooms:
        print("(free: -, an object store has no free-space figure, and init does not check its room)")
    rates = ",".join(
        f"{r.path}={r.read_bandwidth / 1e6:.0f}MB/s:{r.write_bandwidth / 1e6:.0f}MB/s"
        + (f":{DUPLEX}" if r.serial < 0.5 else "")
        for r in results
    )
    print(f"for jax-mlp plan elsewhere: --paths {rates}")
    return 0


def _together(serial: float) -> str:
    """What the probe's third phase found: a full-duplex path, one pipe, or between (the ``serial`` share)."""
    if serial < 0.5:
        return f"{DUPLEX} ({serial:.2f})"
    return f"one pipe ({serial:.2f})" if serial > 0.8 else f"partly ({serial:.2f})"


COMMAND = Command(
    name="probe",
    handle=handle,
    summary="measure the read and write bandwidth of storage paths, through the tier code training uses",
    description=(
        "Writes records to a scratch folder (.jax_mlp_probe) on each path, several in flight, drops them\n"
        "from the page cache, reads them back, prints the bandwidths (read first, as every rate in\n"
        "jax_mlp is written) and the free space, and removes the folder. The records are those training\n"
        "writes: zarr3 arrays through tensorstore, with a checksummed header. With --state, it also prints\n"
        "the room each path needs for its share of that much offloaded state, split by the measured\n"
        "bandwidths: the figure init checks. Its last line is the --paths of jax-mlp plan for these paths.\n\n"
        "example:\n"
        "  jax-mlp probe /local/nvme/run1 /lustre/proj/run1\n"
        "  jax-mlp probe /local/nvme/run1 --size 1GiB --record 64MiB\n"
        "  jax-mlp probe /local/nvme/run1 /lustre/proj/run1 --state 80GiB\n"
        "  jax-mlp probe /local/nvme/run1 --json"
    ),
    arguments=(
        argument(
            "paths",
            nargs="+",
            metavar="PATH",
            help="directories to measure (created if missing), or object stores: a URL such as s3://bucket/prefix "
            "or a tensorstore kvstore spec in JSON",
        ),
        argument("--size", default=PROBE_SIZE, help="bytes written and read back per path (default: %(default)s)"),
        argument("--record", default=PROBE_RECORD, help="size of each record (default: %(default)s)"),
        argument(
            "--inflight", type=int, default=PROBE_INFLIGHT, help="records in flight at once (default: %(default)s)"
        ),
        argument("--state", default=None, help="offloaded state of one process, e.g. 80GiB: print each path's need"),
        argument(
            "--subgroup-size",
            default=DEFAULTS["subgroup_size"],
            help="bytes per subgroup, with --state (default: OffloadConfig's, %(default)s)",
        ),
        argument("--json", action="store_true", help="print the same figures as JSON, one object per path, unrounded"),
    ),
)
