"""Saving: a pinned step streamed out of the tiers into the arrays of the standard layout, region by region.

Each process writes the regions of the blocks it holds replica 0 of (process 0 writes leaves on one
device and those every subgroup holds alike), and reads only the subgroups that have such regions.
Process 0 creates the arrays; the others open them with the same metadata, agreed on here.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import tensorstore as ts

from jax_mlp._src import peers
from jax_mlp._src.checkpoint.items import StreamedLeaf
from jax_mlp._src.checkpoint.layout import Region, chunk_shape, host_block, interior_gcd, layout_of, region_of
from jax_mlp._src.config import OffloadConfig
from jax_mlp._src.errors import OffloadError, RecordError
from jax_mlp._src.offload.inputs import check_tree
from jax_mlp._src.offload.layers import LayerStream
from jax_mlp._src.offload.offloader import Offloader
from jax_mlp._src.plan import remainders
from jax_mlp._src.plan.partition import Box, Plan
from jax_mlp._src.plan.sharding import LeafSharding
from jax_mlp._src.storage.tier_stack import Pin
from jax_mlp._src.stream.engine import Engine


class Source(NamedTuple):
    """What a save streams out of: a run's optimizer, plan and placement, and its records at a pinned step.

    Attributes:
      inner: the inner optimizer.
      config: the run's options (the save's pipeline depths and timeouts).
      plan: the subgroups.
      sharding: each leaf's sharding and owned shards.
      pin: flushes and pins the run's current step (see :meth:`TierStack.pin`).
      read: ``read(pin, k)``: subgroup ``k``'s ``(state leaves, master leaves)`` at the pinned step, and,
        ``with_params``, its params leaves third; each record read is unpinned.
      records: ``records(k)``: the record indices of subgroup ``k`` (unpinned unread when another process
        saves them).
      with_params: the params are records too (a layer stream): the checkpoint holds them beside the state.
    """

    inner: optax.GradientTransformation
    config: OffloadConfig
    plan: Plan
    sharding: LeafSharding
    pin: Callable[[], Pin]
    read: Callable[[Pin, int], tuple]
    records: Callable[[int], tuple[int, ...]]
    with_params: bool


def offload_source(offloader: Offloader) -> Source:
    """The :class:`Source` of an ``mlp_offload``: its state records (the params are the user's)."""
    live = offloader.initialised()
    return Source(
        offloader.inner,
        offloader.config,
        live.plan,
        live.sharding,
        offloader.pin,
        offloader.read_pinned,
        lambda k: (k,),
        with_params=False,
    )


def layer_source(stream: LayerStream) -> Source:
    """The :class:`Source` of a ``stream_layers`` run: each subgroup's state record and its params record."""
    plan = stream.plan
    if plan is None:
        raise OffloadError("this stream_layers has not been initialised: call init (or restore a checkpoint) first")

    def read(pin: Pin, k: int) -> tuple:
        return (*stream.read_pinned(pin, k), stream.read_pinned(pin, plan.params_record(k))[0])

    return Source(
        stream.inner,
        stream.config,
        plan.plan,
        plan.sharding,
        stream.pin,
        read,
        lambda k: (k, plan.params_record(k)),
        with_params=True,
    )


class SaveStream:
    """One save: streams a pinned step out of the tiers into the arrays of the standard layout.

    Each process writes the regions of the blocks it holds replica 0 of (process 0 writes leaves
    on one device and the shared ones), and reads only the subgroups that have such regions. Process
    0 creates the arrays; the others open them with the same metadata, agreed on here.
    """

    def __init__(self, source: Source, pin: Pin, name: str, params: Any):
        self.source = source
        self.pin = pin
        plan, sharding = source.plan, source.sharding
        self.layout = layout_of(source.inner, plan, source.with_params)
        primary = jax.process_index() == 0
        self.writes = tuple(
            tuple(
                primary if r.box is None else sharding.written_here(r.param, plan.leaves[r.param].shape, r.box)
                for r in regions
            )
            for regions in self.layout.regions
        )
        own = [k for k, regions in enumerate(self.layout.regions) if any(self._own(regions, self.writes[k]))]
        shared = any(r.shared for regions in self.layout.regions for r in regions)
        self.subgroups = own or ([0] if primary and shared else [])
        for k in set(range(len(plan.subgroups))) - set(self.subgroups):
            for record in source.records(k):
                pin.mark_read(record)  # another process writes it: an update need not wait for it
        self.chunks = self._chunks(sharding, name)
        # A layer stream's params records hold the high halves of remainder masters; else the user gives them.
        self.high_halves = {} if source.with_params else _high_halves(plan, self.layout.regions, self.subgroups, params)
        self._shared: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _own(regions: Sequence[Region], writes: Sequence[bool]) -> list[bool]:
        return [w and not r.shared for r, w in zip(regions, writes, strict=True)]

    def _chunks(self, sharding: LeafSharding, name: str) -> list[tuple[int, ...]]:
        """Each array's zarr3 chunk (see :func:`chunk_shape`), the same in every process."""
        layout, plan = self.layout, self.source.plan
        blocks: list[list[Box]] = [[] for _ in layout.leaves]
        rows: list[list[int]] = [[] for _ in layout.leaves]
        for k in self.subgroups:
            for region, own in zip(layout.regions[k], self._own(layout.regions[k], self.writes[k]), strict=True):
                if not own or region.box is None:
                    continue
                rows[region.leaf].extend(region.box[0] if region.box else ())
                if sharding.shardings[region.param] is not None and not blocks[region.leaf]:
                    shape = plan.leaves[region.param].shape
                    blocks[region.leaf] = [box for box, _ in sharding.blocks_of(region.param, shape)]
        gcds = [interior_gcd(r, x.shape[0] if x.shape else 1) for r, x in zip(rows, layout.leaves, strict=True)]
        if jax.process_count() > 1:
            timeout = self.source.config.peer_timeout
            # A process may hold no block of a leaf: blocks come from the first that does.
            shared = peers.all_values(name, json.dumps([gcds, blocks]), timeout, "a checkpoint save")
            everyone = [json.loads(value) for value in shared]
            gcds = [math.gcd(*column) for column in zip(*(g for g, _ in everyone), strict=True)]
            blocks = [next((b for b in column if b), []) for column in zip(*(b for _, b in everyone), strict=True)]
        return [
            chunk_shape(tuple(x.shape), np.dtype(x.dtype).itemsize, leaf_blocks, gcd)
            for x, leaf_blocks, gcd in zip(layout.leaves, blocks, gcds, strict=True)
        ]

    def placeholders(self) -> Any:
        """The standard layout's tree with a :class:`StreamedLeaf` of this stream at every leaf."""
        leaves = [StreamedLeaf(self, i) for i in range(len(self.layout.leaves))]
        return jax.tree_util.tree_unflatten(self.layout.treedef, leaves)

    def _open(self, leaf: int, info: ocp.type_handlers.ParamInfo) -> Any:
        """Process 0 creates the array; the others open it with the same metadata, which needs no read."""
        shape, dtype = self.layout.leaves[leaf].shape, np.dtype(self.layout.leaves[leaf].dtype)
        spec = ocp.type_handlers.get_json_tspec_write(
            info, use_ocdbt=False, global_shape=shape, local_shape=self.chunks[leaf], dtype=dtype
        )
        if jax.process_index() == 0:
            return ts.open(spec, create=True, open=True, context=info.ts_context).result()
        return ts.open(spec, open=True, assume_metadata=True, context=info.ts_context).result()

    def _store(self, arrays: list, index: int, fetched: tuple) -> None:
        state_leaves, master_leaves, *params = fetched
        params_leaves = params[0] if params else []
        if params_leaves:
            flags = remainders.held_as_remainders(self.source.plan.subgroups[index].layout.master_fields)
            halves = [p if flag else None for p, flag in zip(params_leaves, flags, strict=False)]
        else:
            halves = self.high_halves.get(index, itertools.repeat(None))
        master_leaves = [
            m if high is None else np.asarray(remainders.rebuild(high, m))
            for m, high in zip(master_leaves, halves, strict=False)
        ]
        writes = []
        for region, value, write in zip(
            self.layout.regions[index], [*state_leaves, *master_leaves, *params_leaves], self.writes[index], strict=True
        ):
            if not write or (region.shared and not self._claim(region, value)):
                continue
            writes.append(region_of(arrays[region.leaf], region).write(value))
        for write in writes:
            write.result()

    def _claim(self, region: Region, value: np.ndarray) -> bool:
        """Whether this subgroup writes the shared leaf (the first one does); later ones must equal it."""
        with self._lock:
            first = self._shared.get(region.leaf)
            if first is None:
                self._shared[region.leaf] = np.array(value)
                return True
        if first.tobytes() != np.asarray(value).tobytes():
            raise RecordError(
                f"state leaf {self.layout.names[region.leaf]} differs between subgroups ({first} and {value}); "
                "the tiers hold inconsistent steps: resume them, or restore another checkpoint"
            )
        return False

    def write(self, leaves: Sequence[StreamedLeaf], infos: Sequence[ocp.type_handlers.ParamInfo]) -> None:
        """Streams this process's subgroups of the pinned step into the arrays, then releases the pin."""
        source, pin = self.source, self.pin
        config = source.config
        engine = Engine(config.prefetch_depth, config.write_depth, config.io_timeout)
        try:
            arrays: list[Any] = [None] * len(self.layout.leaves)
            for leaf, info in zip(leaves, infos, strict=True):
                arrays[leaf.index] = self._open(leaf.index, info)
            engine.pipeline(
                self.subgroups,
                lambda k: source.read(pin, k),
                lambda _, fetched: fetched,
                lambda k, fetched: self._store(arrays, k, fetched),
            )
        finally:
            engine.close()
            pin.release()


def _high_halves(
    plan: Plan, regions: Sequence[Sequence[Region]], subgroups: Sequence[int], params: Any
) -> dict[int, list[np.ndarray | None]]:
    """Per subgroup of ``subgroups`` with remainder masters, each master field's param block on the host
    (None for a whole master): the high halves that rebuild the masters a checkpoint holds."""
    needed = {k: remainders.held_as_remainders(plan.subgroups[k].layout.master_fields) for k in subgroups}
    needed = {k: flags for k, flags in needed.items() if any(flags)}
    if not needed:
        return {}
    if params is None:
        raise OffloadError(
            "this mlp_offload keeps its fp32 masters as remainders (master_storage='remainder'): the params are "
            "their high halves, so the save needs them: pass jax_mlp.OffloadSave(offload, params)"
        )
    leaves = check_tree(plan, params, "params", check_dtype=True)
    halves = {}
    for k, flags in needed.items():
        subgroup = plan.subgroups[k]
        masters = regions[k][len(subgroup.layout.state_fields) :]
        halves[k] = [
            host_block(leaves[piece.leaf], region.box) if flag else None
            for piece, region, flag in zip(subgroup.pieces, masters, flags, strict=True)
        ]
    return halves
