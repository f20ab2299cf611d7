"""``jax-mlp plan --params-in tiers``: a layer-streamed run (``jax_mlp.stream_layers``) sized per step and per path.

The run keeps its params, grads and optimizer state in the tiers (docs/layers.md). Each step the
forward reads every params record and the backward every one but the last layer's, which stays on
the device (less the turnarounds a host cache keeps), the update reads every state record, and both
are written once. Per process and per step:

- reads ``(P - min(C, P)) + (P - U - min(C, P - U)) + S``, writes ``P + S``, with ``P`` the params
  records' bytes, ``U`` one layer's, ``S`` the state records' and ``C`` the host cache: the forward's
  first units are the update's last writes, and the backward's first units the forward's last reads,
  each up to ``C``; a clipping that fires adds up to ``P + S`` each way;
- split over the paths in the shares of the model's best split, each path busy for its bytes at its
  rates; the step takes the longest of its paths and the forward and backward;
- every written byte wears the drives: bytes written per day per path, against an endurance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from jax_mlp._src.cli.sizing import Workload
from jax_mlp._src.parsing import format_bytes
from jax_mlp._src.schedule.performance import PathSpeed, best_split

DAY = 86_400.0


class StreamedStep(NamedTuple):
    """One layer-streamed step of one process: bytes moved, memory, and per path its share of them.

    Attributes:
      params_bytes: ``P``, the params records.
      state_bytes: ``S``, the state records.
      read_bytes: the step's reads.
      write_bytes: the step's writes.
      device_bytes: what a device holds of the params and grads: three layers' params, two layers' grads
        and one layer's new params (activations not counted).
      paths: per path: its share, bytes read and written, busy seconds.
      seconds: the step: its slowest path, or the forward and backward if longer (None: unknown).
      deferred: the updates are deferred to the next forward (``G``, the grads, written and read).
    """

    params_bytes: float
    state_bytes: float
    read_bytes: float
    write_bytes: float
    device_bytes: float
    paths: tuple[dict[str, float | str], ...]
    seconds: float | None
    deferred: bool = False


def streamed_bytes(
    params_bytes: float,
    state_bytes: float,
    cache_bytes: float,
    layer_bytes: float,
    grads_bytes: float = 0,
    kept_bytes: float = 0,
) -> tuple[float, float]:
    """``(read, write)`` bytes of one step: the params read by the forward, but for the ``kept_bytes`` it takes
    from the last step's update as it made them, and by the backward, but for the last layer's ``layer_bytes``
    (less the cache's turnarounds); the state once, and both written once; the grads (``grads_bytes``, with
    ``clipping="defer"``) written once and read once."""
    forward, backward = params_bytes - kept_bytes, params_bytes - layer_bytes
    read = forward - min(cache_bytes, forward) + backward - min(cache_bytes, backward) + state_bytes
    return read + grads_bytes, params_bytes + state_bytes + grads_bytes


def streamed_step(
    work: Workload,
    speeds: Sequence[PathSpeed],
    cache_bytes: float,
    compute_seconds: float | None,
    *,
    deferred: bool = False,
) -> StreamedStep:
    """A layer-streamed step of ``work`` on ``speeds``' paths, with ``cache_bytes`` of host cache per process;
    ``deferred``: each update deferred to the next forward, the grads (as many bytes as the params) stored."""
    processes = work.nodes * work.processes_per_node
    params = work.params * work.param_bytes / processes
    state = work.state_bytes
    one_layer = params / work.layers  # the last (the backward's first), and the first (the forward takes it)
    grads, kept = (params, 0) if deferred else (0, one_layer)
    read, write = streamed_bytes(params, state, cache_bytes, one_layer, grads, kept)
    shares = best_split(speeds)
    paths = []
    for speed, share in zip(speeds, shares, strict=True):
        seconds = speed.seconds(share * read * work.processes_per_node, share * write * work.processes_per_node)
        paths.append({"name": speed.name, "share": share, "read": share * read, "write": share * write, "s": seconds})
    slowest = max(p["s"] for p in paths)
    seconds = None if compute_seconds is None else max(slowest, compute_seconds)
    layer = work.params * work.param_bytes / work.layers / work.devices
    return StreamedStep(params, state, read, write, 6 * layer, tuple(paths), seconds, deferred)


def print_streamed(step: StreamedStep, work: Workload, endurance: float | None) -> None:
    """The tables of a layer-streamed run: bytes per step per path, wear, device memory."""
    print(
        f"layer-streamed step (--params-in tiers): params records {format_bytes(step.params_bytes)}, state records "
        f"{format_bytes(step.state_bytes)} per process; reads {format_bytes(step.read_bytes)} "
        f"(2P - U - cache + S{' + G' * step.deferred}), writes {format_bytes(step.write_bytes)} "
        f"(P + S{' + G' * step.deferred}) per step; a device holds "
        f"{format_bytes(step.device_bytes)} of params and grads ({work.layers} layers: 3 layers' params, 2 layers' "
        "grads, 1 layer's new params) besides the activations"
    )
    known = step.seconds is not None and step.seconds > 0
    print(f"{'path':<12} {'share':>6} {'read/step':>11} {'write/step':>11} {'busy':>9} {'TB written/day':>15}  wear")
    for path in step.paths:
        node_write = path["write"] * work.processes_per_node
        per_day = node_write * DAY / step.seconds if known else math.nan
        wear = (
            "-" if endurance is None or not known else f"{endurance / per_day:,.0f} days to {format_bytes(endurance)}"
        )
        print(
            f"{path['name']:<12} {path['share']:>6.1%} {format_bytes(path['read']):>11} "
            f"{format_bytes(path['write']):>11} {path['s']:>8.2f}s {per_day / 1e12:>15.1f}  {wear}"
        )
    if known:
        print(f"predicted step: {step.seconds:.2f} s (the slowest path, or the forward and backward)\n")
    else:
        print("predicted step: give --compute-s (or --tflops and --tokens-per-step) for the step and the wear\n")
