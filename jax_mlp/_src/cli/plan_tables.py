"""The tables ``jax-mlp plan`` prints: per device, per node, per path, per update and per step; or their figures as JSON."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from jax_mlp._src.cli.ablation import Variant
from jax_mlp._src.cli.sizing import (
    FUSED_RECORDS,
    PROCESS_BYTES,
    Compute,
    Workload,
    device_memory,
    host_memory,
    link_seconds,
)
from jax_mlp._src.cli.speeds import path_needs, record_sizes
from jax_mlp._src.parsing import format_bytes, parse_size
from jax_mlp._src.schedule.performance import PathSpeed, Prediction
from jax_mlp._src.storage import capacity, local
from jax_mlp._src.storage.buffers import POOL_BYTES


def format_seconds(value: float) -> str:
    return f"{value:.3g} s" if value < 1000 else f"{value / 60:.3g} min"


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


def ratio(baseline: float, seconds: float) -> str:
    return f"{baseline / seconds:.2f}x" if seconds > 0 else "-"


def print_device(args: argparse.Namespace, work: Workload, param_dtype: str) -> None:
    """Per device: the params, the grads and the peak an update adds, by route."""
    device = device_memory(work)
    updates = "fp32 (the master's)" if args.master else param_dtype
    in_flight = f"{FUSED_RECORDS} records: the subgroup computing (in and out), the one before it being staged"
    if work.params_in_host:
        print(
            f"per device: params and grads in host memory, in {param_dtype}, streamed through the devices a layer at "
            f"a time (a layer: --params / {work.layers}); activations not counted"
        )
        _row("params, streamed", format_bytes(device.params), "2 layers: the one computing, whole, and the next")
        _row("grads, streamed", format_bytes(device.grads), "2 layers, on their way to host memory")
        blocks = f"the grads and params of {work.write_depth + 2} subgroups in, their results out"
        _row("update adds, optax route", format_bytes(device.optax_route), f"records in flight, and {blocks}")
        _row("update adds, fused apply", format_bytes(device.fused_apply), f"{in_flight}, and {blocks}")
    else:
        print(f"per device: params sharded over {work.devices} device(s), in {param_dtype}; activations not counted")
        _row("params", format_bytes(device.params))
        _row("grads", format_bytes(device.grads))
        _row("update adds, optax route", format_bytes(device.optax_route), f"updates in {updates}, and new params")
        _row("update adds, fused apply", format_bytes(device.fused_apply), in_flight)
    for route, adds in (("optax route", device.optax_route), ("fused apply", device.fused_apply)):
        peak = device.params + device.grads + adds
        _row(f"peak, {route}", format_bytes(peak), _fits(peak, "--device-memory", args.device_memory))
    print()


def print_host(args: argparse.Namespace, work: Workload, cache: float) -> None:
    """Per node: host RAM for the cache, the records in flight, the staging buffers and the runtime."""
    host = host_memory(work, cache)
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
        f"ASSUMED {format_bytes(PROCESS_BYTES)} a process (Python, JAX)",
    )
    if work.params_in_host:
        _row("params", format_bytes(host.params), "the node's share, in pinned_host")
        _row("grads", format_bytes(host.grads))
        optax_total = host.total + host.optax_route
        note = f"the updates and new params; total then {format_bytes(optax_total)}"
        fits = _fits(optax_total, "--host-memory", args.host_memory)
        _row("update adds, optax route", format_bytes(host.optax_route), f"{note}{'; ' + fits if fits else ''}")
        _row("update adds, fused apply", format_bytes(0), "each block replaced where it lies")
    note = _fits(host.total, "--host-memory", args.host_memory)
    if args.host_memory is not None:
        room = parse_size(args.host_memory, name="--host-memory") - (host.total - host.cache)
        state = work.state_bytes * per_node
        whole = f"; a --host-cache of {format_bytes(state)} holds the whole state"
        note += whole if room >= state else f"; the largest --host-cache that fits: {format_bytes(max(0, room))}"
    _row("total", format_bytes(host.total), note)
    print()


def _needs(speeds: Sequence[PathSpeed], work: Workload) -> list[int]:
    """The room each path needs for its share of one process's records."""
    return path_needs(speeds, record_sizes(work.state_bytes, work.subgroup_bytes), [capacity.BLOCK] * len(speeds))


def print_paths(speeds: Sequence[PathSpeed], work: Workload, full: Prediction) -> None:
    """Per path: its share, the bytes it moves per update, its busy time, the room it needs and has."""
    processes_per_node = work.processes_per_node
    needs = _needs(speeds, work)
    print(
        f"{'path':<12} {'share':>7} {'read/update':>14} {'written/update':>15} {'busy':>10} {'needs/node':>12} "
        f"{'free':>12}"
    )
    for speed, share, read, written, busy, need in zip(
        speeds, full.shares, full.bytes_read, full.bytes_written, full.path_seconds, needs, strict=True
    ):
        print(
            f"{speed.name:<12} {share:>7.1%} {format_bytes(read):>14} {format_bytes(written):>15} {format_seconds(busy):>10} "
            f"{format_bytes(need * processes_per_node):>12} {_free(speed.name, need * processes_per_node):>12}"
        )
    print(
        f"(read/written: one process's, during the update; busy: the path's, for the {processes_per_node} "
        f"process(es) of a node; needs/node: two slots of each record of the path's share, plus "
        f"{capacity.HEADROOM:.0%} headroom; free: where the path is a directory here)\n"
    )


def print_update(args: argparse.Namespace, work: Workload, full: Prediction, link: float) -> None:
    """Per update: bytes read and written during it and after it (the write-back, the writes that run on), the link
    floor, the time."""
    print(f"per update, one process (x{work.processes_per_node} per node)")
    _row("read during the update", format_bytes(sum(full.bytes_read)))
    _row("written during the update", format_bytes(sum(full.bytes_written)))
    back = "the cache's write-back, " if args.flush == "idle" else ""
    _row("written after the update", format_bytes(full.idle_write_bytes), f"{back}its last writes run on")
    _row("I/O between updates", format_seconds(full.idle_io_seconds), "those writes and the first reads ahead")
    moved = "the state, grads and params in, state and updates out" if work.params_in_host else "the state in and out"
    _row(
        "link floor",
        format_seconds(link_seconds(work, link)),
        f"{moved} at {link / 1e9:.3g} GB/s a device, each way (ASSUMED)",
    )
    _row("update", format_seconds(full.seconds))
    print()


def print_step(compute: Compute, full: Prediction, steps: tuple[float, float] | None, trips: float) -> None:
    """Per step: the forward and backward, whether the I/O between updates fits in it, the params' trips, the step
    split and overlapped (``steps``, None when the forward and backward are unknown).

    ``trips`` is the seconds the params and grads take over the link in the forward and backward, when
    they live in host memory (0 otherwise; no row then): the steps count them with the forward and backward.
    """
    print("per step")
    if trips:
        note = "params in twice (forward, backward), grads out, a device's shard; ASSUMED not hidden by compute"
        _row("params and grads over link", format_seconds(trips), note)
    if compute.seconds is None:
        _row("forward + backward", "?", compute.source)
        _row("I/O between updates", format_seconds(full.idle_io_seconds), "assumed to fit in the forward and backward")
        what = "this, the trips above" if trips else "this"
        _row("update", format_seconds(full.seconds), f"step: {what} plus the forward and backward")
        print()
        return
    _row("forward + backward", format_seconds(compute.seconds), compute.source)
    wait = full.idle_io_seconds - compute.seconds
    fit = (
        f"does not fit: the update waits {format_seconds(wait)} more"
        if wait > 0
        else "fits in the forward and backward"
    )
    _row("I/O between updates", format_seconds(full.idle_io_seconds), fit)
    _row("update", format_seconds(full.seconds))
    for (label, note), step in zip(_STEPS, steps, strict=True):
        throughput = f"{compute.tokens / step:.3g} tokens/s; " if compute.tokens else ""
        _row(label, format_seconds(step), throughput + note)
    print()


_STEPS = (
    ("step, split", "the update after the forward and backward"),
    ("step, overlapped", "offload.overlap: the update streams during the backward"),
)


def figures(
    work: Workload,
    speeds: Sequence[PathSpeed],
    cache: float,
    link: float,
    compute: Compute,
    mechanisms: Sequence[tuple[Variant, Prediction]],
    steps: tuple[float, float] | None,
    trips: float,
) -> dict:
    """The figures of every table, unrounded, for ``jax-mlp plan --json``: bytes, seconds and bytes/s.

    ``mechanisms`` is each ablation variant with its prediction, the last one (``full``) the run's; ``steps``
    and ``trips`` are as for :func:`print_step`.
    """
    full = mechanisms[-1][1]
    host = host_memory(work, cache)
    paths = [
        {
            "name": speed.name,
            "read_bandwidth": speed.read_bandwidth,
            "write_bandwidth": speed.write_bandwidth,
            "serial": speed.serial,
            "share": share,
            "bytes_read": read,
            "bytes_written": written,
            "busy_s": busy,
            "needs_per_node": need * work.processes_per_node,
        }
        for speed, share, read, written, busy, need in zip(
            speeds,
            full.shares,
            full.bytes_read,
            full.bytes_written,
            full.path_seconds,
            _needs(speeds, work),
            strict=True,
        )
    ]
    return {
        "params": work.params,
        "state_bytes": work.state_bytes,
        "records": work.num_records,
        "record_bytes": work.record_bytes,
        "cache_bytes": cache,
        "device": device_memory(work)._asdict(),
        "host": {**host._asdict(), "total": host.total},
        "paths": paths,
        "update": {
            "seconds": full.seconds,
            "bytes_read": sum(full.bytes_read),
            "bytes_written": sum(full.bytes_written),
            "idle_write_bytes": full.idle_write_bytes,
            "idle_io_s": full.idle_io_seconds,
            "link_floor_s": link_seconds(work, link),
        },
        "step": {
            "forward_backward_s": compute.seconds,
            "params_link_s": trips,
            "split_s": None if steps is None else steps[0],
            "overlapped_s": None if steps is None else steps[1],
        },
        "mechanisms": [
            {
                **variant._asdict(),
                "seconds": prediction.seconds,
                "bytes_read": list(prediction.bytes_read),
                "bytes_written": list(prediction.bytes_written),
            }
            for variant, prediction in mechanisms
        ],
    }
