"""A whole run as ``jax-mlp plan`` sizes it: device memory, host RAM, the link floor, compute from FLOPs.

:class:`Workload` describes the run (the model, how it is spread over nodes, processes and devices,
and how its state streams); the functions here size what the performance model of one update
(:mod:`~jax_mlp._src.schedule.performance`) leaves out: the bytes on each device
(:func:`device_memory`), the host RAM of each node (:func:`host_memory`), the update's floor when no
storage I/O is on its path (:func:`link_seconds`), the params' and grads' trips over the link when
they live in host memory (:func:`params_link_seconds`) and the forward and backward from FLOPs
(:func:`flops_seconds`). Given the model's leaves, its records are packed as ``mlp_offload`` packs them
(:func:`packed_records`); else they are cut from the state at the subgroup size (:func:`records`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from jax_mlp._src.plan import partition
from jax_mlp._src.storage.buffers import POOL_BYTES

PROCESS_BYTES = 2 * 1024**3
"""Host RAM assumed for one training process's own runtime (Python, JAX, XLA's host buffers): an assumption."""


def records(state_bytes: float, subgroup_bytes: float) -> tuple[int, float]:
    """The records a plan cuts ``state_bytes`` into with subgroups of ``subgroup_bytes``: their count and size."""
    return max(1, math.ceil(state_bytes / subgroup_bytes)), subgroup_bytes


class _FlatRate:
    """A whole leaf's bytes in a record at a flat rate per param: the estimator :func:`packed_records` packs with."""

    def __init__(self, specs: Sequence[partition.LeafSpec], bytes_per_param: float):
        self._specs, self._rate = specs, bytes_per_param

    def piece_nbytes(self, piece: partition.Piece) -> int:
        return math.ceil(math.prod(self._specs[piece.leaf].shape) * self._rate)


def packed_records(leaf_shapes: Sequence[tuple[int, ...]], bytes_per_param: float, subgroup_bytes: int) -> int:
    """How many records ``mlp_offload`` packs these leaves' state into: whole leaves in the order given, a leaf above
    ``subgroup_bytes`` cut into row chunks (:func:`~jax_mlp._src.plan.partition.group_pieces`)."""
    specs = [partition.LeafSpec(f"[{i}]", tuple(shape), np.dtype(np.float32)) for i, shape in enumerate(leaf_shapes)]
    pieces = [partition.Piece(leaf) for leaf in range(len(specs))]
    return len(partition.group_pieces(specs, pieces, _FlatRate(specs, bytes_per_param), subgroup_bytes))


class Workload(NamedTuple):
    """A training run as ``jax-mlp plan`` sizes it: the model, how it is spread, and how its state streams.

    The params (and grads) are taken as sharded over every device (FSDP), and the offloaded state over
    every process, as ``mlp_offload`` splits it. With ``params_in_host`` the params and grads live in
    host memory (``pinned_host``) and the step streams them through the devices a layer at a time
    (``examples/host_params.py``).

    Attributes:
      params: parameters of the model.
      param_bytes: bytes of one param, and of its gradient, on the device: 2 for bf16, 4 for fp32.
      update_bytes: bytes of one element of the updates ``update`` returns: the master's with one.
      state_bytes_per_param: offloaded bytes per param: the inner state as stored, plus a master copy.
      nodes: nodes the run spans.
      processes_per_node: processes of a node, sharing its paths and its host RAM.
      devices_per_node: accelerators of a node.
      subgroup_bytes: ``subgroup_size``: bytes of state (and master) streamed at once.
      prefetch_depth: ``prefetch_depth``: records read ahead of the one being updated.
      write_depth: ``write_depth``: records whose writes may trail behind.
      params_in_host: the params and grads live in host memory, not on the devices.
      layers: the model's layers, of ``params / layers`` each: with ``params_in_host``, what a device holds
        of the params at a time.
      leaf_shapes: the shapes of the leaves one process offloads, in the order they are packed, or empty:
        then the state is cut into records of ``subgroup_bytes``.
    """

    params: float
    param_bytes: int
    update_bytes: int
    state_bytes_per_param: float
    nodes: int
    processes_per_node: int
    devices_per_node: int
    subgroup_bytes: int
    prefetch_depth: int
    write_depth: int
    params_in_host: bool = False
    layers: int = 1
    leaf_shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def devices(self) -> int:
        """Accelerators of the whole run."""
        return self.nodes * self.devices_per_node

    @property
    def state_bytes(self) -> float:
        """Offloaded bytes of one process."""
        return self.params * self.state_bytes_per_param / (self.nodes * self.processes_per_node)

    @property
    def num_records(self) -> int:
        """Records (subgroups) of one process: its leaves packed, or its state cut at the subgroup size."""
        if self.leaf_shapes:
            return packed_records(self.leaf_shapes, self.state_bytes_per_param, self.subgroup_bytes)
        return records(self.state_bytes, self.subgroup_bytes)[0]

    @property
    def record_bytes(self) -> float:
        """Bytes of one record: the mean of the leaves' records; else a subgroup, or the whole state of a process
        that holds less."""
        if self.leaf_shapes:
            return self.state_bytes / self.num_records
        return min(self.subgroup_bytes, self.state_bytes)

    @property
    def process_params(self) -> float:
        """Params whose state one process offloads."""
        return self.params / (self.nodes * self.processes_per_node)

    @property
    def subgroup_blocks(self) -> float:
        """With params in host memory, a subgroup's blocks on the device: its grads and params in, updates out."""
        return self.record_bytes / self.state_bytes_per_param * (2 * self.param_bytes + self.update_bytes)


FUSED_RECORDS = 3
"""Records the fused ``apply`` holds on a device: the subgroup computing (its state in and out) and the one
before it while the engine's stager copies it to the host; its writes in flight hold host copies only."""


class DeviceMemory(NamedTuple):
    """Bytes on one device: what it holds through the step, and what an update adds on top, by route.

    Attributes:
      params: the device's shard of the params; with the params in host memory, the two layers streaming.
      grads: its shard of the gradients, in the params' dtype; with the params in host memory, two layers'.
      optax_route: the peak ``update`` followed by ``optax.apply_updates`` adds.
      fused_apply: the peak the fused ``apply`` adds.
    """

    params: float
    grads: float
    optax_route: float
    fused_apply: float


def device_memory(work: Workload) -> DeviceMemory:
    """What one device holds during a step (activations left out).

    The optax route holds the tree of updates (the master's dtype when there is one: fp32 updates of
    bf16 params take twice their bytes), plus the larger of the records on the device while the update
    streams (``prefetch_depth + 2``: read ahead, computing, being staged to the host) and the new params
    that ``optax.apply_updates`` makes beside the old. The fused ``apply`` donates the params and frees
    each gradient after its last subgroup, so it adds only the records of the subgroup computing (its
    state in and out) and of the one before it being staged to the host: :data:`FUSED_RECORDS`, whatever
    ``write_depth``, since the writes in flight hold host copies only. In docs/efficiency.md's measured
    setup (64 MiB of bf16 params, 8 MiB subgroups, an fp32 master) this gives 3.0× and 0.375× the params,
    against 3.0× (4.0× on the first step) and 0.33–0.375× measured.

    With the params in host memory, a device holds two layers of params (the one computing, whole
    once FSDP gathered it, and the next coming in) and two of grads (going out), and an update adds
    to either route's records the blocks of the subgroups whose programs may be in flight (at most
    ``write_depth + 2``), never a tree of updates.

    Args:
      work: the run.

    Returns:
      The bytes per device.
    """
    if work.params_in_host:
        layers = 2 * work.params / work.layers * work.param_bytes
        blocks = (work.write_depth + 2) * work.subgroup_blocks
        records = (work.prefetch_depth + 2) * work.record_bytes
        return DeviceMemory(layers, layers, records + blocks, FUSED_RECORDS * work.record_bytes + blocks)
    params = work.params / work.devices * work.param_bytes
    streaming = (work.prefetch_depth + 2) * work.record_bytes
    updates = work.params / work.devices * work.update_bytes
    return DeviceMemory(
        params=params,
        grads=params,
        optax_route=updates + max(streaming, params),
        fused_apply=FUSED_RECORDS * work.record_bytes,
    )


class HostMemory(NamedTuple):
    """Bytes of host RAM on one node, by what holds them.

    Attributes:
      cache: the host cache, as much of it as the node's state fills.
      in_flight: records being read or written: ``prefetch_depth + write_depth`` per process, plus one
        dirty record being evicted.
      staging: the record buffer pool each process keeps for reuse (at most ``POOL_BYTES``); an upper
        bound, since the records in flight may be its buffers.
      processes: the processes' own runtime, :data:`PROCESS_BYTES` each: an assumption.
      params: with the params in host memory, the node's share of them (else 0).
      grads: likewise, of the grads.
      optax_route: with the params in host memory, what ``update`` and ``optax.apply_updates`` add: the
        updates, and the new params beside the old (the fused ``apply`` adds nothing); else 0.
    """

    cache: float
    in_flight: float
    staging: float
    processes: float
    params: float = 0.0
    grads: float = 0.0
    optax_route: float = 0.0

    @property
    def total(self) -> float:
        """All of it, with the fused ``apply`` (``optax_route`` left out)."""
        return self.cache + self.in_flight + self.staging + self.processes + self.params + self.grads


def host_memory(work: Workload, cache_bytes: float) -> HostMemory:
    """The host RAM one node needs for the offload.

    Args:
      work: the run.
      cache_bytes: the host cache of one process (``host_cache``).

    Returns:
      The bytes per node.
    """
    per_node = work.processes_per_node
    node_params = work.params / work.nodes if work.params_in_host else 0.0
    return HostMemory(
        cache=per_node * min(cache_bytes, work.state_bytes),
        in_flight=per_node * (work.prefetch_depth + work.write_depth + 1) * work.record_bytes,
        staging=per_node * min(POOL_BYTES, work.state_bytes),
        processes=per_node * PROCESS_BYTES,
        params=node_params * work.param_bytes,
        grads=node_params * work.param_bytes,
        optax_route=node_params * (work.update_bytes + work.param_bytes),
    )


def link_seconds(work: Workload, link_bandwidth: float) -> float:
    """The update's floor with no storage I/O on its path: each process's state crossing its devices' links.

    Every update moves the whole state to the device and back; the two directions run at once, and a
    process driving several devices uses all their links. With the params in host memory the grads and
    params go in as well, and the updates come back. The update's own arithmetic (a few bytes per
    param at the device's memory bandwidth) is far below this and left out.

    Args:
      work: the run.
      link_bandwidth: host-device bytes/s of one device, each way (PCIe).

    Returns:
      Seconds.
    """
    links = max(1, work.devices_per_node // work.processes_per_node)
    params = work.process_params if work.params_in_host else 0.0
    inward = work.state_bytes + params * 2 * work.param_bytes
    outward = work.state_bytes + params * work.update_bytes
    return max(inward, outward) / (links * link_bandwidth)


def params_link_seconds(work: Workload, link_bandwidth: float) -> float:
    """With the params in host memory, the forward's and backward's trips over each device's link.

    The forward and the backward each bring the device's shard of the params in (FSDP gathers the
    rest over the devices' own links), and the backward sends its shard of the grads out, the other
    direction, meanwhile. Taken as added to the step: a scan that brings the next layer in while the
    current one computes hides some of it.

    Args:
      work: the run.
      link_bandwidth: host-device bytes/s of one device, each way.

    Returns:
      Seconds; 0 with the params in device memory.
    """
    if not work.params_in_host:
        return 0.0
    return 2 * work.params / work.devices * work.param_bytes / link_bandwidth


def flops_seconds(params: float, tokens: float, devices: int, flops: float, mfu: float) -> float:
    """Forward and backward time of one step from its arithmetic: ``6 × params × tokens / (devices × flops × mfu)``.

    Args:
      params: parameters of the model.
      tokens: tokens of one step, over all devices.
      devices: accelerators of the run.
      flops: peak FLOP/s of one device.
      mfu: the fraction of the peak the model reaches.

    Returns:
      Seconds.
    """
    return 6 * params * tokens / (devices * flops * mfu)


class Compute(NamedTuple):
    """The forward and backward of one step: its seconds and tokens (None when unknown), where the seconds come from."""

    seconds: float | None
    source: str
    tokens: float | None
