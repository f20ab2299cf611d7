"""Storage paths named on the command line: their speeds (probed here, or declared) and the room each needs."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

from jax_mlp._src.cli.command import UsageError, rate
from jax_mlp._src.cli.sizing import records
from jax_mlp._src.config import Path
from jax_mlp._src.errors import OffloadError
from jax_mlp._src.parsing import parse_size
from jax_mlp._src.schedule.performance import PathSpeed, best_split, measured_speed
from jax_mlp._src.schedule.scheduler import weighted_interleave
from jax_mlp._src.storage import capacity
from jax_mlp._src.storage.bandwidth import ProbeResult, probe
from jax_mlp._src.storage.record import HEADER_SIZE

PROBE_SIZE, PROBE_RECORD, PROBE_INFLIGHT = "256MiB", "16MiB", 4
"""What ``jax-mlp probe`` moves per path, in records of what size, how many in flight; ``plan`` probes alike."""


def is_store(entry: str) -> bool:
    """Whether a path argument names an object store: a URL (``s3://bucket/prefix``, not ``URL=RATE``) or a JSON spec."""
    return ("://" in entry and "=" not in entry) or entry.lstrip().startswith("{")


def parse_entry(entry: str) -> str | dict:
    """A path argument as ``Path`` takes it: a kvstore spec given as JSON (e.g. with an S3 ``endpoint``) as a dict."""
    if not entry.lstrip().startswith("{"):
        return entry
    try:
        return json.loads(entry)
    except json.JSONDecodeError as error:
        raise UsageError(f"path {entry!r} starts with '{{' but is not a JSON kvstore spec: {error}") from None


def probe_location(location: str, total: int, record: int, inflight: int) -> ProbeResult:
    """``jax_mlp._src.storage.bandwidth.probe`` of a directory or a store, a failure as a :class:`UsageError`."""
    try:
        return probe(Path(parse_entry(location)), total_bytes=total, record_bytes=record, inflight=inflight)
    except OffloadError as error:
        raise UsageError(str(error)) from None


DUPLEX = "duplex"
"""The suffix of a ``--paths`` entry whose path reads and writes at once at full speed (``NAME=READ:WRITE:duplex``)."""


def declared_speed(item: str) -> PathSpeed:
    """``NAME=RATE`` or ``NAME=READ:WRITE``, read first, as ``jax-mlp probe`` prints them; ``:duplex`` at the end
    for a path whose directions do not slow each other (a kernel throttle per direction, a PFS client's link)."""
    name, _, rates = item.partition("=")
    if not name or not rates:
        raise UsageError(
            f"--paths entry {item!r} is neither a directory here nor NAME=RATE or NAME=READ:WRITE, e.g. nvme=5GB/s"
        )
    rates, duplex = rates.removesuffix(f":{DUPLEX}"), rates.endswith(f":{DUPLEX}")
    read, _, write = rates.partition(":")
    serial = 0.0 if duplex else 1.0
    return PathSpeed(name, rate(read, f"{name} read"), rate(write or read, f"{name} write"), serial)


def path_speeds(entries: Sequence[str], probe_bytes: int, say: Callable[[str], None] = print) -> list[PathSpeed]:
    """The speed of each ``--paths`` entry: a directory here or a store is probed; ``NAME=READ:WRITE`` entries are read.

    An entry that is not a directory may list several paths, comma-separated. ``say`` reports each probe.
    """
    speeds = []
    for entry in entries:
        for item in [entry] if os.path.isdir(entry) or is_store(entry) else entry.split(","):
            if os.path.isdir(item) or is_store(item):
                result = probe_location(item, probe_bytes, min(parse_size(PROBE_RECORD), probe_bytes), PROBE_INFLIGHT)
                read, write = result.read_bandwidth / 1e6, result.write_bandwidth / 1e6
                say(f"probed {result.path}: read {read:.0f} MB/s, write {write:.0f} MB/s")
                speeds.append(measured_speed(result))
            else:
                speeds.append(declared_speed(item))
    return speeds


def record_sizes(state: float, subgroup: int) -> list[int]:
    """The record sizes of ``state`` bytes of offloaded state cut into subgroups of ``subgroup`` bytes."""
    count, _ = records(state, subgroup)
    return [HEADER_SIZE + subgroup] * (count - 1) + [HEADER_SIZE + max(0, int(state) - (count - 1) * subgroup)]


def path_needs(speeds: Sequence[PathSpeed], records: Sequence[int], blocks: Sequence[int]) -> list[int]:
    """What each path needs for its share of ``records`` split as ``init`` would split them (see capacity)."""
    placement = weighted_interleave(records, best_split(speeds))
    return [
        capacity.need([nbytes for nbytes, at in zip(records, placement, strict=True) if at == index], block)
        for index, block in enumerate(blocks)
    ]
