"""``jax-mlp plan``: sizes a run from its model and paths, with the performance model the scheduler uses."""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys

import jax.numpy as jnp
import numpy as np

from jax_mlp._src import state_codecs
from jax_mlp._src.cli import plan_tables
from jax_mlp._src.cli.ablation import ABLATION, predict_variant, predict_variant_step
from jax_mlp._src.cli.command import DEFAULTS, Command, UsageError, argument, parse_count, rate
from jax_mlp._src.cli.sizing import Compute, Workload, flops_seconds, link_seconds, params_link_seconds
from jax_mlp._src.cli.speeds import PROBE_SIZE, path_speeds
from jax_mlp._src.cli.streamed import print_streamed, streamed_step
from jax_mlp._src.parsing import format_bytes, parse_size
from jax_mlp._src.plan import remainders

MASTER_BYTES = 4
"""Bytes per param of the fp32 master copy (``--master``), and of its update."""
_DTYPES = {"bf16": np.dtype(jnp.bfloat16), "fp16": np.dtype(np.float16), "fp32": np.dtype(np.float32)}


def _param_dtype(args: argparse.Namespace) -> str:
    return args.param_dtype or ("bf16" if args.master else "fp32")


def _stored_master_bytes(args: argparse.Namespace) -> int:
    """Bytes per param of the master in the records: none, or as ``mlp_offload`` stores it (a remainder or whole)."""
    if not args.master:
        return 0
    return remainders.stored_master_dtype(_DTYPES[_param_dtype(args)], np.float32, args.master_storage).itemsize


def _workload(args: argparse.Namespace) -> Workload:
    """The run the arguments describe, refusing counts that would make it empty."""
    for flag in ("nodes", "processes_per_node", "devices_per_node", "prefetch_depth", "write_depth", "layers"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    for flag in ("contention", "mfu"):
        if not 0 < getattr(args, flag) <= 1:
            raise UsageError(f"--{flag} must be in (0, 1], got {getattr(args, flag)}")
    if args.params_in in ("host", "tiers") and args.layers is None:
        raise UsageError(
            f"--params-in {args.params_in} needs --layers: a device then holds the params a layer at a time"
        )
    subgroup = parse_size(args.subgroup_size, name="--subgroup-size")
    if subgroup <= 0:
        raise UsageError("--subgroup-size must be positive")
    param_bytes = _DTYPES[_param_dtype(args)].itemsize
    processes = args.nodes * args.processes_per_node
    leaves = _leaf_shapes(args.leaves)
    return Workload(
        params=_params(args, leaves),
        param_bytes=param_bytes,
        update_bytes=MASTER_BYTES if args.master else param_bytes,
        state_bytes_per_param=args.state_bytes_per_param * state_codecs.stored_fraction(args.state_codec)
        + _stored_master_bytes(args),
        nodes=args.nodes,
        processes_per_node=args.processes_per_node,
        devices_per_node=args.devices_per_node or args.processes_per_node,
        subgroup_bytes=subgroup,
        prefetch_depth=args.prefetch_depth,
        write_depth=args.write_depth,
        params_in_host=args.params_in == "host",
        layers=args.layers or 1,
        leaf_shapes=tuple((-(-shape[0] // processes), *shape[1:]) if shape else shape for shape in leaves),
    )


def _leaf_shapes(specs: list[str] | None) -> list[tuple[int, ...]]:
    """The shapes ``--leaves`` gives, each ``D1xD2...`` repeated ``:COUNT`` times (``2048x2048:8``)."""
    shapes = []
    for spec in specs or ():
        shape, _, count = spec.partition(":")
        try:
            dims, times = tuple(int(d) for d in shape.split("x")) if shape else (), int(count or 1)
        except ValueError:
            dims, times = (-1,), 0
        if times < 1 or any(d < 1 for d in dims):
            raise UsageError(
                f"--leaves {spec!r} is not a leaf's shape: write e.g. 2048x2048, or 2048x2048:8 for 8 of them"
            )
        shapes += [dims] * times
    return shapes


def _params(args: argparse.Namespace, leaves: list[tuple[int, ...]]) -> float:
    """``--params``, or the leaves' sum; both given, they must agree."""
    total = sum(math.prod(shape) for shape in leaves)
    if args.params is None:
        if not leaves:
            raise UsageError(
                "give the model's size as --params (e.g. 7B) or its leaves as --leaves (e.g. 4096x4096:32)"
            )
        return total
    params = parse_count(args.params, "--params")
    if leaves and abs(params - total) > 0.005 * total:
        raise UsageError(f"--params {args.params} is not the {total} params of --leaves: give one, or make them agree")
    return params


def _compute(args: argparse.Namespace, work: Workload) -> Compute:
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
    seconds = flops_seconds(work.params, tokens, work.devices, args.tflops * 1e12, args.mfu)
    source = (
        f"estimated: 6 x {work.params:.3g} params x {tokens:.3g} tokens / "
        f"({work.devices} devices x {args.tflops:g} TFLOP/s x MFU {args.mfu:g})"
    )
    return Compute(seconds, source, tokens)


def _update_compute(args: argparse.Namespace, work: Workload, link: float) -> float:
    """The update's own time with no storage I/O: given (``--update-compute-s``), else the link floor."""
    if args.update_compute_s is None:
        return link_seconds(work, link)
    if args.update_compute_s < 0:
        raise UsageError(f"--update-compute-s must not be negative, got {args.update_compute_s}")
    return args.update_compute_s


def handle(args: argparse.Namespace) -> int:
    """``jax-mlp plan``: sizes a run: device memory, host RAM, disk, and the update's and step's time."""
    work = _workload(args)
    say = functools.partial(print, file=sys.stderr) if args.json else print  # --json keeps stdout to the JSON
    speeds = path_speeds(args.paths, parse_size(args.probe_size, name="--probe-size"), say)
    cache = parse_size(args.host_cache, name="--host-cache") / work.processes_per_node
    compute = _compute(args, work)
    link = rate(args.link, "--link")
    trips = params_link_seconds(work, link)  # the params' and grads' trips over the link, with params on the host
    idle = math.inf if compute.seconds is None else compute.seconds + trips  # the disks idle through both
    common = dict(
        num_records=work.num_records,
        record_bytes=work.record_bytes,
        cache_bytes=cache,
        processes_per_node=work.processes_per_node,
        contention=args.contention,
        compute_seconds=_update_compute(args, work, link),
        prefetch_depth=work.prefetch_depth,
        write_depth=work.write_depth,
        write_back=args.flush == "idle",
    )
    variants = [predict_variant(variant, speeds, idle_seconds=idle, **common) for variant in ABLATION]
    full = variants[-1]
    steps = None
    if compute.seconds is not None:
        steps = tuple(
            predict_variant_step(ABLATION[-1], speeds, forward_backward_seconds=idle, overlapped=o, **common)
            for o in (False, True)
        )
    if args.params_in == "tiers":
        endurance = None if args.endurance is None else parse_size(args.endurance, name="--endurance")
        deferred = args.clipping == "defer"
        print_streamed(streamed_step(work, speeds, cache, compute.seconds, deferred=deferred), work, endurance)
        return 0
    if args.json:
        mechanisms = list(zip(ABLATION, variants, strict=True))
        print(json.dumps(plan_tables.figures(work, speeds, cache, link, compute, mechanisms, steps, trips), indent=1))
        return 0
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
        f"predicted update time: {plan_tables.format_seconds(full.seconds)}; {format_bytes(full.idle_write_bytes)} written after "
        f"it, {plan_tables.format_seconds(full.idle_io_seconds)} of I/O between updates in all\n"
    )
    plan_tables.print_device(args, work, _param_dtype(args))
    plan_tables.print_host(args, work, cache)
    plan_tables.print_paths(speeds, work, full)
    plan_tables.print_update(args, work, full, link)
    plan_tables.print_step(compute, full, steps, trips)
    baseline = variants[0].seconds
    print(f"{'mechanisms':<22} {'update':>10} {'vs baseline':>12}")
    for variant, prediction in zip(ABLATION, variants, strict=True):
        seconds = prediction.seconds
        print(
            f"{variant.name:<22} {plan_tables.format_seconds(seconds):>10} {plan_tables.ratio(baseline, seconds):>12}"
        )
    return 0


COMMAND = Command(
    name="plan",
    handle=handle,
    summary="size a run: device memory, host RAM, disk per path, and the update's and the step's time",
    description=(
        "Applies the performance model that the scheduler uses (jax_mlp/_src/schedule/performance.py) to a run and prints:\n"
        "  per device: the params, the grads and the peak an update adds, for the optax route (update,\n"
        "    then optax.apply_updates) and for the fused apply (activations are not counted);\n"
        "  per node: host RAM for the cache, the records in flight, the staging buffers and the\n"
        "    processes' own runtime (an assumption), against --host-memory if given;\n"
        "  per path: its share, the bytes it moves per update, the room it needs (and its free space,\n"
        "    where the path is a directory on this machine);\n"
        "  per update: bytes read and written, the write-back of the cache between updates, the time;\n"
        "  per step: the update plus the forward and backward (--compute-s, or estimated from --tflops),\n"
        "    and with --params-in host the params' and grads' trips over the link;\n"
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
        "  jax-mlp plan --params 7e9 --paths nvme=6GB/s --master --state-codec int8\n"
        "  jax-mlp plan --params 7e9 --paths nvme=6GB/s --compute-s 4 --json\n"
        "  jax-mlp plan --leaves 2048x2048:8 --master --paths nvme=300MB/s:300MB/s:duplex pfs=150MB/s:150MB/s:duplex \\\n"
        "      --host-cache 96MiB --compute-s 0.1\n"
        "  jax-mlp plan --params 70B --master --params-in host --layers 80 --processes-per-node 4 \\\n"
        "      --paths nvme=6.5GB/s:3GB/s lustre=3GB/s:2GB/s --host-cache 200GiB --device-memory 40GB\n"
        "  jax-mlp plan --params 175B --master --params-in tiers --layers 96 --processes-per-node 4 \\\n"
        "      --paths nvme=6.5GB/s:3GB/s lustre=3GB/s:2GB/s --host-cache 200GiB --compute-s 60 --endurance 14PB"
    ),
    arguments=(
        argument("--params", default=None, help="parameters of the model, e.g. 70B, 7e9 or 1.5e9 (K, M, B, T)"),
        argument(
            "--leaves",
            nargs="+",
            default=None,
            metavar="SHAPE[:COUNT]",
            help="the model's param leaves in the order of their names, e.g. 2048x2048:8 2048:8: its records are "
            "then packed as mlp_offload packs them (whole leaves, large ones in row chunks), not cut at "
            "--subgroup-size; --params is then their sum",
        ),
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
            choices=("none", *state_codecs.CODECS),
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
        argument(
            "--params-in",
            choices=("device", "host", "tiers"),
            default="device",
            help="where the params and grads live: on the devices; in host memory (pinned_host), streamed "
            "through the devices a layer at a time, as in examples/host_params.py; or in the tiers with the "
            "state, a layer-streamed run (jax_mlp.stream_layers, docs/layers.md) (default: %(default)s)",
        ),
        argument(
            "--clipping",
            choices=("speculate", "defer"),
            default="speculate",
            help="with --params-in tiers: when a clipped step's update runs (stream_layers' clipping); defer "
            "writes and reads the grads every step (default: %(default)s)",
        ),
        argument(
            "--endurance",
            default=None,
            help="with --params-in tiers: the bytes each path's drives are rated to write, e.g. 14PB, for the "
            "days until they wear out",
        ),
        argument(
            "--layers",
            type=int,
            default=None,
            help="layers of the model, of --params / --layers each; needed with --params-in host or tiers",
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
            "--update-compute-s",
            type=float,
            default=None,
            help="seconds of one update with no storage I/O, e.g. measured with the whole state in the host cache "
            "(default: the link floor, the state crossing --link)",
        ),
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
        argument("--json", action="store_true", help="print the same figures as one JSON object, unrounded"),
    ),
)
