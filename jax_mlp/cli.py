"""The ``jax-mlp`` command.

Each sub-command is a function ``run(args) -> exit status`` plus one :class:`Command` entry in
``COMMANDS`` that names it, explains it and lists its arguments. A user mistake (a missing file, a
malformed log) is raised as :class:`UsageError` and printed as one line, with exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from jax_mlp import model, quantized
from jax_mlp.config import Path, format_bytes, parse_rate, parse_size
from jax_mlp.errors import OffloadError
from jax_mlp.model import PathSpeed
from jax_mlp.scheduler import weighted_interleave
from jax_mlp.storage import capacity, local
from jax_mlp.storage.record import HEADER_SIZE

PROG = "jax-mlp"


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


def _parse_paths(spec: str) -> list[PathSpeed]:
    """``nvme=5GB/s,pfs=2GB/s:1GB/s``: a name and a bandwidth (or read:write) per path."""
    speeds = []
    for item in spec.split(","):
        name, _, rates = item.partition("=")
        if not name or not rates:
            raise UsageError(f"--paths entry {item!r} is not NAME=RATE or NAME=READ:WRITE, e.g. nvme=5GB/s")
        read, _, write = rates.partition(":")
        speeds.append(PathSpeed(name, _rate(read, f"{name} read"), _rate(write or read, f"{name} write")))
    return speeds


def _seconds(value: float) -> str:
    return f"{value:.3g} s" if value < 100 else f"{value / 60:.3g} min"


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
    from jax_mlp.storage.probe import probe

    total, record = parse_size(args.size, name="--size"), parse_size(args.record, name="--record")
    results, rooms = [], []
    for location in args.paths:
        try:
            results.append(probe(Path(location), total_bytes=total, record_bytes=record, inflight=args.inflight))
        except OffloadError as error:
            raise UsageError(str(error)) from None
        rooms.append(local.room(location))
    needs = None
    if args.state is not None:
        records = _records(
            parse_size(args.state, name="--state"), parse_size(args.subgroup_size, name="--subgroup-size")
        )
        needs = _needs([model.measured_speed(r) for r in results], records, [room.block for room in rooms])
    print(f"{'path':<40} {'write':>12} {'read':>12} {'free':>12}" + (f" {'needs':>12}" if needs else ""))
    for index, (result, room) in enumerate(zip(results, rooms, strict=True)):
        line = f"{result.path:<40} {result.write_bandwidth / 1e6:>9.0f} MB/s {result.read_bandwidth / 1e6:>9.0f} MB/s"
        line += f" {format_bytes(room.free):>12}"
        if needs:
            line += f" {format_bytes(needs[index]):>12}" + ("  (short)" if needs[index] > room.free else "")
        print(line)
    if needs:
        print(f"(needs: two slots of each record of its share of {args.state}, plus {capacity.HEADROOM:.0%} headroom)")
    return 0


def _free(name: str, need: int) -> str:
    """The free space of a path named by a directory on this machine (marked if short of ``need``), else ``-``."""
    if not os.path.isdir(name):
        return "-"
    free = local.room(name).free
    return format_bytes(free) + (" (short)" if need > free else "")


def plan_command(args: argparse.Namespace) -> int:
    """``jax-mlp plan``: predicts the update time, split and traffic of a configuration."""
    speeds = _parse_paths(args.paths)
    per_param = args.state_bytes_per_param * quantized.stored_fraction(args.state_codec) + (4 if args.master else 0)
    processes_per_node = args.processes_per_node
    state = args.params * per_param / (args.nodes * processes_per_node)
    num_records, record = model.records(state, parse_size(args.subgroup_size, name="--subgroup-size"))
    cache = parse_size(args.host_cache, name="--host-cache") / processes_per_node
    common = dict(
        num_records=num_records,
        record_bytes=record,
        cache_bytes=cache,
        processes_per_node=processes_per_node,
        contention=args.contention,
    )
    full = model.predict_variant(model.ABLATION[-1], speeds, **common)
    print(
        f"{args.params:.3g} params, {per_param:.3g} B of offloaded state each: {format_bytes(state)} per process, "
        f"{processes_per_node} process(es) per node, host cache {format_bytes(cache)} per process"
    )
    print(f"predicted update time: {_seconds(full.seconds)}\n")
    needs = _needs(speeds, _records(state, record), [capacity.BLOCK] * len(speeds))
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
    print(f"(+ {format_bytes(full.idle_write_bytes)} written back from the cache between updates)")
    print(
        f"(needs/node: two slots of each record of the path's share, for the {processes_per_node} process(es) of "
        f"a node, plus {capacity.HEADROOM:.0%} headroom; free: where NAME is a directory here)\n"
    )
    baseline = model.predict_variant(model.ABLATION[0], speeds, **common).seconds
    print(f"{'mechanisms':<22} {'update':>10} {'vs baseline':>12}")
    for variant in model.ABLATION:
        seconds = model.predict_variant(variant, speeds, **common).seconds
        print(f"{variant.name:<22} {_seconds(seconds):>10} {baseline / seconds:>11.2f}x")
    return 0


COMMANDS: tuple[Command, ...] = (
    Command(
        name="probe",
        run=probe_command,
        summary="measure the read and write bandwidth of storage paths, through the tier code training uses",
        description=(
            "Writes records to a scratch folder (.jax_mlp_probe) on each path, several in flight, drops them\n"
            "from the page cache, reads them back, prints the bandwidths and the free space, and removes the\n"
            "folder. The records are those training writes: zarr3 arrays through tensorstore, with a\n"
            "checksummed header. With --state, it also prints the room each path needs for its share of that\n"
            "much offloaded state, split by the measured bandwidths: the figure init checks.\n\n"
            "example:\n"
            "  jax-mlp probe /local/nvme/run1 /lustre/proj/run1\n"
            "  jax-mlp probe /local/nvme/run1 --size 1GiB --record 64MiB\n"
            "  jax-mlp probe /local/nvme/run1 /lustre/proj/run1 --state 80GiB"
        ),
        arguments=(
            argument("paths", nargs="+", metavar="PATH", help="directories to measure (created if missing)"),
            argument("--size", default="256MiB", help="bytes written and read back per path (default: %(default)s)"),
            argument("--record", default="16MiB", help="size of each record (default: %(default)s)"),
            argument("--inflight", type=int, default=4, help="records in flight at once (default: %(default)s)"),
            argument(
                "--state", default=None, help="offloaded state of one process, e.g. 80GiB: print each path's need"
            ),
            argument(
                "--subgroup-size", default="256MiB", help="bytes per subgroup, with --state (default: %(default)s)"
            ),
        ),
    ),
    Command(
        name="plan",
        run=plan_command,
        summary="predict the update time, the split over paths and the bytes moved, mechanism by mechanism",
        description=(
            "Applies the performance model that the scheduler uses (jax_mlp/model.py) to a model size, the\n"
            "paths' bandwidths and the host cache, and prints the predicted update time, the best split over\n"
            "the paths, the bytes each path moves per update, the room each path needs for its share (and its\n"
            "free space, where NAME is a directory on this machine), and the gain of each mechanism.\n\n"
            "example:\n"
            "  jax-mlp plan --params 70e9 --paths nvme=5GB/s,pfs=2GB/s --host-cache 256GiB\n"
            "  jax-mlp plan --params 7e9 --paths nvme=6GB/s:4GB/s --master --processes-per-node 8\n"
            "  jax-mlp plan --params 7e9 --paths nvme=6GB/s --master --state-codec int8"
        ),
        arguments=(
            argument("--params", type=float, required=True, help="parameters of the model, e.g. 70e9"),
            argument(
                "--paths",
                required=True,
                help="NAME=RATE or NAME=READ:WRITE per path, comma-separated, e.g. nvme=5GB/s,pfs=2GB/s:1GB/s",
            ),
            argument("--host-cache", default="0", help="host RAM for the cache, per node (default: %(default)s)"),
            argument("--subgroup-size", default="256MiB", help="bytes per subgroup (default: %(default)s)"),
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
                "4-byte scale per 256 values) (default: %(default)s)",
            ),
            argument("--master", action="store_true", help="also offload an fp32 master copy (4 B per param)"),
            argument("--nodes", type=int, default=1, help="nodes the state is sharded over (default: %(default)s)"),
            argument(
                "--processes-per-node",
                type=int,
                default=1,
                help="processes of a node sharing its paths and host cache (default: %(default)s)",
            ),
            argument(
                "--contention",
                type=float,
                default=0.8,
                help="bandwidth kept when processes collide on a path without the node lock (default: %(default)s)",
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
