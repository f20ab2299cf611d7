"""The ``jax-mlp`` command.

Each sub-command is a function ``run(args) -> exit status`` plus one :class:`Command` entry in
``COMMANDS`` that names it, explains it and lists its arguments. A user mistake (a missing file, a
malformed log) is raised as :class:`UsageError` and printed as one line, with exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from jax_mlp import model, quantized, remainders
from jax_mlp.config import OffloadConfig, Path, format_bytes, parse_rate, parse_size
from jax_mlp.errors import OffloadError
from jax_mlp.model import PathSpeed
from jax_mlp.scheduler import weighted_interleave
from jax_mlp.storage import capacity, local
from jax_mlp.storage.buffers import POOL_BYTES
from jax_mlp.storage.probe import ProbeResult, probe
from jax_mlp.storage.record import HEADER_SIZE

PROG = "jax-mlp"
DEFAULTS = {field.name: field.default for field in dataclasses.fields(OffloadConfig)}
"""``OffloadConfig``'s defaults: ``plan`` and ``probe`` start from the same subgroup size and depths as a run."""
PROBE_SIZE, PROBE_RECORD, PROBE_INFLIGHT = "256MiB", "16MiB", 4
"""What ``jax-mlp probe`` moves per path, in records of what size, how many in flight; ``plan`` probes alike."""
MASTER_BYTES = 4
"""Bytes per param of the fp32 master copy (``--master``), and of its update."""
_DTYPES = {"bf16": np.dtype(jnp.bfloat16), "fp16": np.dtype(np.float16), "fp32": np.dtype(np.float32)}
_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBtT]?)\s*$")
_COUNT_SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


class UsageError(Exception):
    """A mistake in the command line or in the files it names: one line on stderr, exit status 2."""


class Argument(NamedTuple):
    """One ``add_argument`` call: its flags (or positional name) and keyword options."""

    flags: tuple[str, ...]
    options: dict[str, Any]


def argument(*flags: str, **options: Any) -> Argument:
    """An argument of a sub-command, written as for ``argparse.ArgumentParser.add_argument``."""
    return Argument(flags, options)


class Command(NamedTuple):
    """A sub-command.

    Attributes:
      name: what the user types after ``jax-mlp``.
      run: called with the parsed arguments; returns the exit status; raises :class:`UsageError`
        for user mistakes.
      summary: one line for ``jax-mlp --help``.
      description: the text of ``jax-mlp NAME --help``, with an example.
      arguments: the sub-command's arguments.
    """

    name: str
    run: Callable[[argparse.Namespace], int]
    summary: str
    description: str
    arguments: tuple[Argument, ...] = ()


def report(args: argparse.Namespace) -> int:
    """``jax-mlp report``: plots a ``log_to`` file to an image."""
    try:
        from jax_mlp import report as plots
    except ImportError as error:
        raise UsageError(
            f'the report needs matplotlib ({error}); install it with: pip install "jax_mlp[report]"'
        ) from None
    try:
        figure = plots.write_report(args.log, args.output, step=args.step)
    except plots.LogError as error:
        raise UsageError(str(error)) from None
    print(f"wrote {args.output}: " + "; ".join(ax.get_title() for ax in figure.axes))
    return 0


def _rate(text: str, what: str) -> float:
    try:
        return parse_rate(text, name=what)
    except ValueError as error:
        raise UsageError(str(error)) from None


def parse_count(text: str, flag: str) -> float:
    """A positive count such as ``70B``, ``7e9``, ``1.5e9`` or ``4M``: suffixes K, M, B and T, in any case.

    Args:
      text: what the user typed.
      flag: the option, for the message.

    Returns:
      The count.
    """
    match = _COUNT_RE.match(text)
    if not match:
        raise UsageError(f"{flag} {text!r} is not a count: write e.g. 7e9, 7B, 70B or 1.5M (suffixes K, M, B, T)")
    count = float(match.group(1)) * _COUNT_SUFFIXES[match.group(2).lower()]
    if count <= 0:
        raise UsageError(f"{flag} {text!r} must be positive")
    return count


def _is_store(entry: str) -> bool:
    """Whether a path argument names an object store: a URL (``s3://bucket/prefix``, not ``URL=RATE``) or a JSON spec."""
    return ("://" in entry and "=" not in entry) or entry.lstrip().startswith("{")


def _location(entry: str) -> str | dict:
    """A path argument as ``Path`` takes it: a kvstore spec given as JSON (e.g. with an S3 ``endpoint``) as a dict."""
    if not entry.lstrip().startswith("{"):
        return entry
    try:
        return json.loads(entry)
    except json.JSONDecodeError as error:
        raise UsageError(f"path {entry!r} starts with '{{' but is not a JSON kvstore spec: {error}") from None


def _probe(location: str, total: int, record: int, inflight: int) -> ProbeResult:
    """``jax_mlp.storage.probe.probe`` of a directory or a store, a failure as a :class:`UsageError`."""
    try:
        return probe(Path(_location(location)), total_bytes=total, record_bytes=record, inflight=inflight)
    except OffloadError as error:
        raise UsageError(str(error)) from None


def _declared_speed(item: str) -> PathSpeed:
    """``NAME=RATE`` or ``NAME=READ:WRITE``: read first, as ``jax-mlp probe`` prints them."""
    name, _, rates = item.partition("=")
    if not name or not rates:
        raise UsageError(
            f"--paths entry {item!r} is neither a directory here nor NAME=RATE or NAME=READ:WRITE, e.g. nvme=5GB/s"
        )
    read, _, write = rates.partition(":")
    return PathSpeed(name, _rate(read, f"{name} read"), _rate(write or read, f"{name} write"))


def _path_speeds(entries: Sequence[str], probe_bytes: int) -> list[PathSpeed]:
    """The speed of each ``--paths`` entry: a directory here or a store is probed; ``NAME=READ:WRITE`` entries are read.

    An entry that is not a directory may list several paths, comma-separated.
    """
    speeds = []
    for entry in entries:
        for item in [entry] if os.path.isdir(entry) or _is_store(entry) else entry.split(","):
            if os.path.isdir(item) or _is_store(item):
                result = _probe(item, probe_bytes, min(parse_size(PROBE_RECORD), probe_bytes), PROBE_INFLIGHT)
                read, write = result.read_bandwidth / 1e6, result.write_bandwidth / 1e6
                print(f"probed {result.path}: read {read:.0f} MB/s, write {write:.0f} MB/s")
                speeds.append(model.measured_speed(result))
            else:
                speeds.append(_declared_speed(item))
    return speeds


def _seconds(value: float) -> str:
    return f"{value:.3g} s" if value < 1000 else f"{value / 60:.3g} min"


def _records(state: float, subgroup: int) -> list[int]:
    """The record sizes of ``state`` bytes of offloaded state cut into subgroups of ``subgroup`` bytes."""
    count, _ = model.records(state, subgroup)
    return [HEADER_SIZE + subgroup] * (count - 1) + [HEADER_SIZE + max(0, int(state) - (count - 1) * subgroup)]


def _needs(speeds: Sequence[PathSpeed], records: Sequence[int], blocks: Sequence[int]) -> list[int]:
    """What each path needs for its share of ``records`` split as ``init`` would split them (see capacity)."""
    placement = weighted_interleave(records, model.best_split(speeds))
    return [
        capacity.need([nbytes for nbytes, at in zip(records, placement, strict=True) if at == index], block)
        for index, block in enumerate(blocks)
    ]


def probe_command(args: argparse.Namespace) -> int:
    """``jax-mlp probe``: measures each path's bandwidth through the tier code, and its free space."""
    total, record = parse_size(args.size, name="--size"), parse_size(args.record, name="--record")
    results = [_probe(location, total, record, args.inflight) for location in args.paths]
    rooms = [None if _is_store(location) else local.room(location) for location in args.paths]
    needs = None
    if args.state is not None:
        records = _records(
            parse_size(args.state, name="--state"), parse_size(args.subgroup_size, name="--subgroup-size")
        )
        blocks = [capacity.BLOCK if room is None else room.block for room in rooms]
        needs = _needs([model.measured_speed(r) for r in results], records, blocks)
    print(f"{'path':<40} {'read':>12} {'write':>12} {'free':>12}" + (f" {'needs':>12}" if needs else ""))
    for index, (result, room) in enumerate(zip(results, rooms, strict=True)):
        line = f"{result.path:<40} {result.read_bandwidth / 1e6:>9.0f} MB/s {result.write_bandwidth / 1e6:>9.0f} MB/s"
        line += f" {'-' if room is None else format_bytes(room.free):>12}"
        if needs:
            short = room is not None and needs[index] > room.free
            line += f" {format_bytes(needs[index]):>12}" + ("  (short)" if short else "")
        print(line)
    if needs:
        print(f"(needs: two slots of each record of its share of {args.state}, plus {capacity.HEADROOM:.0%} headroom)")
    if None in rooms:
        print("(free: -, an object store has no free-space figure, and init does not check its room)")
    rates = ",".join(f"{r.path}={r.read_bandwidth / 1e6:.0f}MB/s:{r.write_bandwidth / 1e6:.0f}MB/s" for r in results)
    print(f"for jax-mlp plan elsewhere: --paths {rates}")
    return 0


def _free(name: str, need: int) -> str:
    """The free space of a path named by a directory on this machine (marked if short of ``need``), else ``-``."""
    if not os.path.isdir(name):
        return "-"
    free = local.room(name).free
    return format_bytes(free) + (" (short)" if need > free else "")


def _row(label: str, value: str, note: str = "") -> None:
    print(f"  {label:<30} {value:>10}  {note}".rstrip())


def _fits(need: float, flag: str, have: str | None) -> str:
    """Whether ``need`` bytes fit in the ``flag`` the user gave (nothing if none was)."""
    if have is None:
        return ""
    limit = parse_size(have, name=flag)
    if need > limit:
        return f"WARNING: over {flag} {format_bytes(limit)} by {format_bytes(need - limit)}"
    return f"fits {flag} {format_bytes(limit)}, {format_bytes(limit - need)} spare"


def _param_dtype(args: argparse.Namespace) -> str:
    return args.param_dtype or ("bf16" if args.master else "fp32")


def _stored_master_bytes(args: argparse.Namespace) -> int:
    """Bytes per param of the master in the records: none, or as ``mlp_offload`` stores it (a remainder or whole)."""
    if not args.master:
        return 0
    return remainders.stored_master_dtype(_DTYPES[_param_dtype(args)], np.float32, args.master_storage).itemsize


def _workload(args: argparse.Namespace) -> model.Workload:
    """The run the arguments describe, refusing counts that would make it empty."""
    for flag in ("nodes", "processes_per_node", "devices_per_node", "prefetch_depth", "write_depth"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    for flag in ("contention", "mfu"):
        if not 0 < getattr(args, flag) <= 1:
            raise UsageError(f"--{flag} must be in (0, 1], got {getattr(args, flag)}")
    subgroup = parse_size(args.subgroup_size, name="--subgroup-size")
    if subgroup <= 0:
        raise UsageError("--subgroup-size must be positive")
    param_bytes = _DTYPES[_param_dtype(args)].itemsize
    return model.Workload(
        params=parse_count(args.params, "--params"),
        param_bytes=param_bytes,
        update_bytes=MASTER_BYTES if args.master else param_bytes,
        state_bytes_per_param=args.state_bytes_per_param * quantized.stored_fraction(args.state_codec)
        + _stored_master_bytes(args),
        nodes=args.nodes,
        processes_per_node=args.processes_per_node,
        devices_per_node=args.devices_per_node or args.processes_per_node,
        subgroup_bytes=subgroup,
        prefetch_depth=args.prefetch_depth,
        write_depth=args.write_depth,
    )


class Compute(NamedTuple):
    """The forward and backward of one step: its seconds and tokens (None when unknown), where the seconds come from."""

    seconds: float | None
    source: str
    tokens: float | None


def _compute(args: argparse.Namespace, work: model.Workload) -> Compute:
    """The forward and backward time: given (``--compute-s``), estimated from FLOPs (``--tflops``), or unknown."""
    tokens = None if args.tokens_per_step is None else parse_count(args.tokens_per_step, "--tokens-per-step")
    if args.compute_s is not None and args.tflops:
        raise UsageError("give --compute-s or --tflops, not both")
    if args.compute_s is not None:
        if args.compute_s < 0:
            raise UsageError(f"--compute-s must not be negative, got {args.compute_s}")
        return Compute(args.compute_s, "given (--compute-s)", tokens)
    if not args.tflops:
        return Compute(None, "not given (--compute-s, or --tflops with --tokens-per-step)", tokens)
    if args.tflops < 0 or tokens is None:
        raise UsageError("--tflops needs a positive value and --tokens-per-step")
    seconds = model.flops_seconds(work.params, tokens, work.devices, args.tflops * 1e12, args.mfu)
    source = (
        f"estimated: 6 x {work.params:.3g} params x {tokens:.3g} tokens / "
        f"({work.devices} devices x {args.tflops:g} TFLOP/s x MFU {args.mfu:g})"
    )
    return Compute(seconds, source, tokens)


def _print_device(args: argparse.Namespace, work: model.Workload) -> None:
    device = model.device_memory(work)
    updates = "fp32 (the master's)" if args.master else _param_dtype(args)
    print(f"per device: params sharded over {work.devices} device(s), in {_param_dtype(args)}; activations not counted")
    _row("params", format_bytes(device.params))
    _row("grads", format_bytes(device.grads))
    _row("update adds, optax route", format_bytes(device.optax_route), f"updates in {updates}, and new params")
    _row(
        "update adds, fused apply",
        format_bytes(device.fused_apply),
        f"{work.write_depth + 2} records: the subgroup computing (in and out), {work.write_depth} being written",
    )
    for route, adds in (("optax route", device.optax_route), ("fused apply", device.fused_apply)):
        peak = device.params + device.grads + adds
        _row(f"peak, {route}", format_bytes(peak), _fits(peak, "--device-memory", args.device_memory))
    print()


def _print_host(args: argparse.Namespace, work: model.Workload, cache: float) -> None:
    host = model.host_memory(work, cache)
    per_node = work.processes_per_node
    print(f"per node: host RAM of {per_node} process(es)")
    whole = " (the whole state)" if cache >= work.state_bytes else ""
    _row("cache", format_bytes(host.cache), f"{format_bytes(cache * per_node)} asked{whole}")
    _row(
        "records in flight",
        format_bytes(host.in_flight),
        f"{work.prefetch_depth} read ahead + {work.write_depth} being written + 1 evicted, per process",
    )
    _row(
        "staging buffers",
        format_bytes(host.staging),
        f"the record buffer pool, at most {format_bytes(POOL_BYTES)} a process",
    )
    _row(
        "process runtime",
        format_bytes(host.processes),
        f"ASSUMED {format_bytes(model.PROCESS_BYTES)} a process (Python, JAX)",
    )
    note = _fits(host.total, "--host-memory", args.host_memory)
    if args.host_memory is not None:
        room = parse_size(args.host_memory, name="--host-memory") - (host.total - host.cache)
        state = work.state_bytes * per_node
        whole = f"; a --host-cache of {format_bytes(state)} holds the whole state"
        note += whole if room >= state else f"; the largest --host-cache that fits: {format_bytes(max(0, room))}"
    _row("total", format_bytes(host.total), note)
    print()


def _print_paths(speeds: Sequence[PathSpeed], work: model.Workload, full: model.Prediction) -> None:
    processes_per_node = work.processes_per_node
    needs = _needs(speeds, _records(work.state_bytes, work.subgroup_bytes), [capacity.BLOCK] * len(speeds))
    print(
        f"{'path':<12} {'share':>7} {'read/update':>14} {'written/update':>15} {'busy':>10} {'needs/node':>12} "
        f"{'free':>12}"
    )
    for speed, share, read, written, busy, need in zip(
        speeds, full.shares, full.bytes_read, full.bytes_written, full.path_seconds, needs, strict=True
    ):
        print(
            f"{speed.name:<12} {share:>7.1%} {format_bytes(read):>14} {format_bytes(written):>15} {_seconds(busy):>10} "
            f"{format_bytes(need * processes_per_node):>12} {_free(speed.name, need * processes_per_node):>12}"
        )
    print(
        f"(read/written: one process's, during the update; busy: the path's, for the {processes_per_node} "
        f"process(es) of a node; needs/node: two slots of each record of the path's share, plus "
        f"{capacity.HEADROOM:.0%} headroom; free: where the path is a directory here)\n"
    )


def _print_update(args: argparse.Namespace, work: model.Workload, full: model.Prediction, link: float) -> None:
    print(f"per update, one process (x{work.processes_per_node} per node)")
    _row("read during the update", format_bytes(sum(full.bytes_read)))
    _row("written during the update", format_bytes(sum(full.bytes_written)))
    back = f'flush="{args.flush}": ' + ("between updates" if args.flush == "idle" else "only when evicted")
    _row("written back from the cache", format_bytes(full.idle_write_bytes), back)
    _row("I/O between updates", _seconds(full.idle_io_seconds), "the write-back and the first reads ahead")
    _row(
        "link floor",
        _seconds(model.link_seconds(work, link)),
        f"the state to the device and back at {link / 1e9:.3g} GB/s a device, each way (ASSUMED)",
    )
    _row("update", _seconds(full.seconds))
    print()


def _print_step(compute: Compute, full: model.Prediction) -> None:
    print("per step")
    if compute.seconds is None:
        _row("forward + backward", "?", compute.source)
        _row("I/O between updates", _seconds(full.idle_io_seconds), "assumed to fit in the forward and backward")
        _row("update", _seconds(full.seconds), "step: this plus the forward and backward")
        print()
        return
    _row("forward + backward", _seconds(compute.seconds), compute.source)
    wait = full.idle_io_seconds - compute.seconds
    fit = f"does not fit: the update waits {_seconds(wait)} more" if wait > 0 else "fits in the forward and backward"
    _row("I/O between updates", _seconds(full.idle_io_seconds), fit)
    _row("update", _seconds(full.seconds))
    step = compute.seconds + full.seconds
    throughput = f"{compute.tokens / step:.3g} tokens/s" if compute.tokens else ""
    _row("step", _seconds(step), throughput)
    print()


def _ratio(baseline: float, seconds: float) -> str:
    return f"{baseline / seconds:.2f}x" if seconds > 0 else "-"


def plan_command(args: argparse.Namespace) -> int:
    """``jax-mlp plan``: sizes a run: device memory, host RAM, disk, and the update's and step's time."""
    work = _workload(args)
    speeds = _path_speeds(args.paths, parse_size(args.probe_size, name="--probe-size"))
    cache = parse_size(args.host_cache, name="--host-cache") / work.processes_per_node
    compute = _compute(args, work)
    link = _rate(args.link, "--link")
    common = dict(
        num_records=work.num_records,
        record_bytes=work.record_bytes,
        cache_bytes=cache,
        processes_per_node=work.processes_per_node,
        contention=args.contention,
        compute_seconds=model.link_seconds(work, link),
        idle_seconds=math.inf if compute.seconds is None else compute.seconds,
        prefetch_depth=work.prefetch_depth,
        write_back=args.flush == "idle",
    )
    full = model.predict_variant(model.ABLATION[-1], speeds, **common)
    print(
        f"{work.params:.3g} params, {work.state_bytes_per_param:.3g} B of offloaded state each: "
        f"{format_bytes(work.state_bytes)} per process, {work.nodes} node(s), {work.processes_per_node} process(es) "
        f"and {work.devices_per_node} device(s) per node, host cache {format_bytes(cache)} per process"
    )
    print(
        f"{work.num_records} records of {format_bytes(work.record_bytes)} per process; prefetch_depth "
        f"{work.prefetch_depth}, write_depth {work.write_depth}, flush={args.flush!r}"
    )
    print(
        f"predicted update time: {_seconds(full.seconds)}; {format_bytes(full.idle_write_bytes)} written back "
        f"between updates, {_seconds(full.idle_io_seconds)} of I/O between updates in all\n"
    )
    _print_device(args, work)
    _print_host(args, work, cache)
    _print_paths(speeds, work, full)
    _print_update(args, work, full, link)
    _print_step(compute, full)
    baseline = model.predict_variant(model.ABLATION[0], speeds, **common).seconds
    print(f"{'mechanisms':<22} {'update':>10} {'vs baseline':>12}")
    for variant in model.ABLATION:
        seconds = model.predict_variant(variant, speeds, **common).seconds
        print(f"{variant.name:<22} {_seconds(seconds):>10} {_ratio(baseline, seconds):>12}")
    return 0


COMMANDS: tuple[Command, ...] = (
    Command(
        name="probe",
        run=probe_command,
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
            "  jax-mlp probe /local/nvme/run1 /lustre/proj/run1 --state 80GiB"
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
            argument(
                "--state", default=None, help="offloaded state of one process, e.g. 80GiB: print each path's need"
            ),
            argument(
                "--subgroup-size",
                default=DEFAULTS["subgroup_size"],
                help="bytes per subgroup, with --state (default: OffloadConfig's, %(default)s)",
            ),
        ),
    ),
    Command(
        name="plan",
        run=plan_command,
        summary="size a run: device memory, host RAM, disk per path, and the update's and the step's time",
        description=(
            "Applies the performance model that the scheduler uses (jax_mlp/model.py) to a run and prints:\n"
            "  per device: the params, the grads and the peak an update adds, for the optax route (update,\n"
            "    then optax.apply_updates) and for the fused apply (activations are not counted);\n"
            "  per node: host RAM for the cache, the records in flight, the staging buffers and the\n"
            "    processes' own runtime (an assumption), against --host-memory if given;\n"
            "  per path: its share, the bytes it moves per update, the room it needs (and its free space,\n"
            "    where the path is a directory on this machine);\n"
            "  per update: bytes read and written, the write-back of the cache between updates, the time;\n"
            "  per step: the update plus the forward and backward (--compute-s, or estimated from --tflops);\n"
            "  and the gain of each mechanism of the paper.\n"
            "Subgroup size, depths, flush and host cache default to OffloadConfig's. Bandwidths are per node;\n"
            "a directory or an object store (s3://bucket/prefix, gs://bucket/prefix, a JSON kvstore spec) in\n"
            "--paths is probed here, as jax-mlp probe does, and NAME=READ:WRITE takes the rates in the order\n"
            "jax-mlp probe prints them.\n\n"
            "example:\n"
            "  jax-mlp plan --params 70B --paths nvme=5GB/s,pfs=2GB/s --host-cache 256GiB\n"
            "  jax-mlp plan --params 7B --master --paths nvme=7GB/s:5GB/s --processes-per-node 8 \\\n"
            "      --host-cache 1TiB --host-memory 2TB --device-memory 80GB --tflops 989 --tokens-per-step 4M\n"
            "  jax-mlp plan --params 7e9 --master --paths /local/nvme/run1 /lustre/proj/run1 --compute-s 4\n"
            "  jax-mlp plan --params 7e9 --paths nvme=6GB/s --master --state-codec int8"
        ),
        arguments=(
            argument("--params", required=True, help="parameters of the model, e.g. 70B, 7e9 or 1.5e9 (K, M, B, T)"),
            argument(
                "--paths",
                required=True,
                nargs="+",
                metavar="PATH",
                help="per path, a directory here (probed) or NAME=RATE or NAME=READ:WRITE, per node, e.g. "
                "nvme=5GB/s,pfs=2GB/s:1GB/s or /local/nvme /lustre/run",
            ),
            argument(
                "--probe-size",
                default=PROBE_SIZE,
                help="bytes written and read back on each directory of --paths (default: %(default)s)",
            ),
            argument(
                "--host-cache",
                default=str(DEFAULTS["host_cache"]),
                help="host RAM for the cache, per node (default: %(default)s)",
            ),
            argument("--host-memory", default=None, help="host RAM of a node, e.g. 512GB: warn if the plan exceeds it"),
            argument("--device-memory", default=None, help="memory of a device, e.g. 80GB: warn if a peak exceeds it"),
            argument(
                "--subgroup-size", default=DEFAULTS["subgroup_size"], help="bytes per subgroup (default: %(default)s)"
            ),
            argument(
                "--prefetch-depth",
                type=int,
                default=DEFAULTS["prefetch_depth"],
                help="records read ahead of the one being updated (default: %(default)s)",
            ),
            argument(
                "--write-depth",
                type=int,
                default=DEFAULTS["write_depth"],
                help="records whose writes may trail behind the update (default: %(default)s)",
            ),
            argument(
                "--flush",
                choices=("idle", "lazy"),
                default=DEFAULTS["flush"],
                help="idle: the cache is written back between updates; lazy: only when evicted (default: %(default)s)",
            ),
            argument(
                "--state-bytes-per-param",
                type=float,
                default=8,
                help="offloaded optimizer state per param: 8 for adam's two fp32 moments (default: %(default)s)",
            ),
            argument(
                "--state-codec",
                choices=("none", *quantized.CODECS),
                default="none",
                help="the state as jax_mlp.quantized_state keeps it: bf16 halves it, int8 quarters it (plus a "
                "4-byte block word per 256 values) (default: %(default)s)",
            ),
            argument("--master", action="store_true", help="also offload an fp32 master copy"),
            argument(
                "--master-storage",
                choices=("remainder", "full"),
                default=DEFAULTS["master_storage"],
                help="with --master and bf16 params: the master as its 2-byte remainder, or whole (4 B) "
                "(default: %(default)s)",
            ),
            argument(
                "--param-dtype",
                choices=tuple(_DTYPES),
                default=None,
                help="the params' (and grads') dtype on the device (default: bf16 with --master, else fp32)",
            ),
            argument("--nodes", type=int, default=1, help="nodes the state is sharded over (default: %(default)s)"),
            argument(
                "--processes-per-node",
                type=int,
                default=1,
                help="processes of a node sharing its paths and host cache (default: %(default)s)",
            ),
            argument(
                "--devices-per-node",
                type=int,
                default=None,
                help="accelerators of a node (default: one per process)",
            ),
            argument(
                "--contention",
                type=float,
                default=0.8,
                help="bandwidth kept when processes collide on a path without the node lock (default: %(default)s)",
            ),
            argument(
                "--link",
                default="20GB/s",
                help="host-device bandwidth of a device, each way: an assumption (default: %(default)s)",
            ),
            argument("--compute-s", type=float, default=None, help="seconds of one step's forward and backward"),
            argument(
                "--tflops",
                type=float,
                default=0,
                help="peak TFLOP/s of a device, to estimate the forward and backward (default: 0, not given)",
            ),
            argument("--tokens-per-step", default=None, help="tokens of one step over all devices, e.g. 4M"),
            argument(
                "--mfu",
                type=float,
                default=0.4,
                help="the fraction of the peak the forward and backward reach (default: %(default)s)",
            ),
        ),
    ),
    Command(
        name="report",
        run=report,
        summary="plot a telemetry log of mlp_offload (reads, compute and writes per path; throughput; placement)",
        description=(
            "Draws a telemetry log into one image with five panels:\n"
            "  1. the timeline of one update: when each path was reading or writing, and when each subgroup's\n"
            "     update was dispatched; I/O done between updates, while the model computed, is on the left;\n"
            "  2. time per update: waiting on reads, computing, waiting on writes;\n"
            "  3. throughput per path (MB/s while busy), against the probed bandwidth when the log has one,\n"
            "     else against the best observed;\n"
            "  4. placement: how many subgroups each path holds, step by step;\n"
            "  5. the host cache: subgroups served from RAM (hits) and read from a path (misses).\n\n"
            "Make the log by passing log_to to mlp_offload:\n"
            "  tx = jax_mlp.mlp_offload(optax.adamw(1e-3), paths=[...], log_to='run.jsonl')\n"
            "or run: python examples/train_gpt.py --log-to run.jsonl\n\n"
            "example:\n"
            "  jax-mlp report run.jsonl -o report.png\n"
            "  jax-mlp report run.jsonl -o step10.pdf --step 10"
        ),
        arguments=(
            argument("log", metavar="LOG", help="the JSON-lines file written by mlp_offload(..., log_to=LOG)"),
            argument(
                "-o",
                "--output",
                default="report.png",
                metavar="IMAGE",
                help="the image to write; .png, .pdf or .svg (default: %(default)s)",
            ),
            argument(
                "--step",
                type=int,
                default=None,
                help="the step whose update the timeline shows (default: the last one in the log)",
            ),
        ),
    ),
)


def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
    """The ``jax-mlp`` argument parser, with one sub-parser per command.

    Args:
      commands: the sub-commands.

    Returns:
      The parser; parsed arguments carry their :class:`Command` as ``command``.
    """
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Tools for jax_mlp, which keeps an optax optimizer's state in host RAM and on storage paths "
            "instead of on the accelerator. Run 'jax-mlp COMMAND --help' for a command's details."
        ),
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for command in commands:
        sub = subparsers.add_parser(
            command.name,
            help=command.summary,
            description=command.description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        for arg in command.arguments:
            sub.add_argument(*arg.flags, **arg.options)
        sub.set_defaults(command=command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``jax-mlp``.

    Args:
      argv: the arguments after the program name; None reads ``sys.argv``.

    Returns:
      The exit status: 0 on success, 2 for a user mistake (reported as one line on stderr).
    """
    args = build_parser().parse_args(argv)
    try:
        return args.command.run(args)
    except UsageError as error:
        print(f"{PROG} {args.command.name}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
