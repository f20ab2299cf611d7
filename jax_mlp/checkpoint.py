"""Orbax checkpoints of the offloaded state, in the standard optax layout, streamed subgroup by subgroup.

A checkpoint item holds the tree that ``inner.init(params)`` returns, or, with master params,
``{"opt_state": <that tree>, "master": <params in master_dtype>}``. It is orbax's own PyTree format
(zarr3 arrays, no OCDBT), so plain optax restores it with ``ocp.args.StandardRestore``. Each array is
filled region by region while the subgroups stream from the tiers: a row chunk of a split leaf is a
row range (and a zarr3 chunk) of its array, and leaves every subgroup holds alike (adam's ``count``)
are written once. Sharded params save their blocks: each block is a region of its array, written
once over all processes, by the one holding its replica 0. Restoring streams the other way, from any
orbax PyTree checkpoint (also OCDBT ones written by plain optax), into any plan: other paths,
subgroup size, host cache, mesh or number of processes; each process reads its own blocks' regions.
The layout and its regions are :mod:`jax_mlp.checkpoint_layout`'s.

See docs/checkpoints.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import math
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import tensorstore as ts

from jax_mlp import partition, peers, quantized, remainders
from jax_mlp.checkpoint_layout import (
    STATE,
    Box,
    Region,
    chunk_shape,
    interior_gcd,
    layout_of,
    region_of,
    slices,
    standard_layout,
)
from jax_mlp.engine import Engine
from jax_mlp.errors import OffloadError, RecordError
from jax_mlp.inputs import check_tree
from jax_mlp.offloader import Offloader, OffloadState
from jax_mlp.partition import Plan
from jax_mlp.storage.tier_stack import Pin
from jax_mlp.transform import OffloadTransformation

if TYPE_CHECKING:
    from etils import epath

_FORMAT = 1
_METADATA_KEY = "jax_mlp"
_SAVES = itertools.count()  # numbers this process's saves alike in every process, for their agreement


@dataclasses.dataclass
class OffloadSave(ocp.args.CheckpointArgs):
    """Saves the state of an ``mlp_offload`` at its current step, in the standard optax layout.

    Attributes:
      offload: what :func:`~jax_mlp.mlp_offload` returned (or its :class:`~jax_mlp.Offloader`), initialised.
      params: the params at the offload's step; needed with ``master_storage="remainder"`` (bf16
        params with fp32 masters), whose records hold only the masters' low halves:
        the checkpoint holds the whole fp32 master, rebuilt from them. Their blocks are copied to the
        host when the save starts, so the params may be updated (or donated) while it streams.
    """

    offload: OffloadTransformation | Offloader
    params: Any = None


@dataclasses.dataclass
class OffloadRestore(ocp.args.CheckpointArgs):
    """Restores a checkpoint in the standard optax layout into a fresh, not yet initialised ``mlp_offload``.

    The checkpoint may come from :class:`OffloadSave` or from plain optax (``ocp.args.StandardSave``
    of ``inner.init(params)``). The ``mlp_offload`` may use other paths, subgroup size and host cache.

    Attributes:
      offload: a new :func:`~jax_mlp.mlp_offload` (without ``resume``); restoring initialises it, so do
        not call its ``init``. Its paths hold no run, or this run's state (the same layout hash, e.g.
        after a crash): the restore replaces that state, with a warning naming the step it held.
      params: the params, or their ``jax.ShapeDtypeStruct``s. Values are needed only when the
        offload keeps master params and the checkpoint has none: the master copy starts from them.
      step: the step of the restored state; by default the one saved, or 0 for a plain optax checkpoint.
    """

    offload: OffloadTransformation | Offloader
    params: Any
    step: int | None = None


def _offloader_of(offload: OffloadTransformation | Offloader) -> Offloader:
    if isinstance(offload, OffloadTransformation):
        return offload.offloader
    if isinstance(offload, Offloader):
        return offload
    raise TypeError(f"expected what jax_mlp.mlp_offload returned, got {type(offload).__name__}")


class _SaveStream:
    """One save: streams a pinned step out of the tiers into the arrays of the standard layout.

    Each process writes the regions of the blocks it holds replica 0 of (process 0 writes leaves
    on one device and the shared ones), and reads only the subgroups that have such regions. Process
    0 creates the arrays; the others open them with the same metadata, agreed on here.
    """

    def __init__(self, offloader: Offloader, pin: Pin, name: str, params: Any):
        self.offloader = offloader
        self.pin = pin
        plan, placement = offloader.plan, offloader.sharding
        self.layout = layout_of(offloader.inner, plan)
        primary = jax.process_index() == 0
        self.writes = tuple(
            tuple(
                primary if r.box is None else placement.written_here(r.param, plan.leaves[r.param].shape, r.box)
                for r in regions
            )
            for regions in self.layout.regions
        )
        own = [k for k, regions in enumerate(self.layout.regions) if any(self._own(regions, self.writes[k]))]
        shared = any(r.shared for regions in self.layout.regions for r in regions)
        self.subgroups = own or ([0] if primary and shared else [])
        for k in set(range(len(plan.subgroups))) - set(self.subgroups):
            pin.mark_read(k)  # another process writes it: an update need not wait for it
        self.chunks = self._chunks(placement, name)
        self.high_halves = _high_halves(plan, self.layout.regions, self.subgroups, params)
        self._shared: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _own(regions: Sequence[Region], writes: Sequence[bool]) -> list[bool]:
        return [w and not r.shared for r, w in zip(regions, writes, strict=True)]

    def _chunks(self, placement: Any, name: str) -> list[tuple[int, ...]]:
        """Each array's zarr3 chunk (see :func:`chunk_shape`), the same in every process."""
        layout, plan = self.layout, self.offloader.plan
        blocks: list[list[Box]] = [[] for _ in layout.leaves]
        rows: list[list[int]] = [[] for _ in layout.leaves]
        for k in self.subgroups:
            for region, own in zip(layout.regions[k], self._own(layout.regions[k], self.writes[k]), strict=True):
                if not own or region.box is None:
                    continue
                rows[region.leaf].extend(region.box[0] if region.box else ())
                if placement.shardings[region.param] is not None and not blocks[region.leaf]:
                    shape = plan.leaves[region.param].shape
                    blocks[region.leaf] = [box for box, _ in placement.blocks_of(region.param, shape)]
        gcds = [interior_gcd(r, x.shape[0] if x.shape else 1) for r, x in zip(rows, layout.leaves, strict=True)]
        if jax.process_count() > 1:
            timeout = self.offloader.config.peer_timeout
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
        """The standard layout's tree with a :class:`_StreamedLeaf` of this stream at every leaf."""
        leaves = [_StreamedLeaf(self, i) for i in range(len(self.layout.leaves))]
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
        state_leaves, master_leaves = fetched
        master_leaves = [
            m if params is None else np.asarray(remainders.rebuild(params, m))
            for m, params in zip(master_leaves, self.high_halves.get(index, itertools.repeat(None)), strict=False)
        ]
        writes = []
        for region, value, write in zip(
            self.layout.regions[index], [*state_leaves, *master_leaves], self.writes[index], strict=True
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

    def write(self, leaves: Sequence[_StreamedLeaf], infos: Sequence[ocp.type_handlers.ParamInfo]) -> None:
        """Streams this process's subgroups of the pinned step into the arrays, then releases the pin."""
        offloader, pin = self.offloader, self.pin
        config = offloader.config
        engine = Engine(config.prefetch_depth, config.write_depth, config.io_timeout)
        try:
            arrays: list[Any] = [None] * len(self.layout.leaves)
            for leaf, info in zip(leaves, infos, strict=True):
                arrays[leaf.index] = self._open(leaf.index, info)
            engine.run(
                self.subgroups,
                lambda k: offloader.read_pinned(pin, k),
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
            _host_block(leaves[piece.leaf], region.box) if flag else None
            for piece, region, flag in zip(subgroup.pieces, masters, flags, strict=True)
        ]
    return halves


class _StreamedLeaf:
    """An orbax leaf standing for one array of the standard layout (not a pytree node).

    Saved, it is written by its :class:`_SaveStream`; as a restore type, it restores as an open
    ``ts.TensorStore`` that is read region by region.
    """

    def __init__(self, stream: _SaveStream, index: int):
        self.stream = stream
        self.index = index


class _StreamedLeafHandler(ocp.type_handlers.TypeHandler):
    """The orbax TypeHandler of :class:`_StreamedLeaf`: streamed writes, lazy reads."""

    def typestr(self) -> str:
        return "jax.Array"  # what the arrays restore as in plain orbax

    async def metadata(self, infos: Sequence[ocp.type_handlers.ParamInfo]) -> Sequence[Any]:
        return await ocp.type_handlers.ArrayHandler().metadata(infos)

    async def serialize(
        self,
        values: Sequence[_StreamedLeaf],
        infos: Sequence[ocp.type_handlers.ParamInfo],
        args: Sequence[ocp.type_handlers.SaveArgs] | None = None,
    ) -> list:
        del args
        stream = values[0].stream

        async def write() -> None:
            await asyncio.gather(*(info.await_path_creation() for info in infos))
            stream.write(values, infos)

        return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="jax_mlp_offload_save")]

    async def deserialize(
        self,
        infos: Sequence[ocp.type_handlers.ParamInfo],
        args: Sequence[ocp.type_handlers.RestoreArgs] | None = None,
    ) -> list:
        del args
        await asyncio.gather(*(info.await_path_creation() for info in infos))
        opened = [
            ts.open(
                ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=bool(info.is_ocdbt_checkpoint)),
                open=True,
                read=True,
                context=info.ts_context,
            )
            for info in infos
        ]
        return list(await asyncio.gather(*opened))


_REGISTRY = ocp.type_handlers.create_type_handler_registry((_StreamedLeaf, _StreamedLeafHandler()))


class _NoArrayMetadataStore(logging.Filter):
    """Drops orbax's one warning that a registry without ``jax.Array`` does not persist ``ArrayMetadata``.

    That metadata describes ``jax.Array`` shards (for subchunking); the streamed leaves have none and
    are written region by region here, so the warning, logged by every save, says nothing to act on.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No jax.Array in TypeHandlerRegistry")


_ARRAY_METADATA_NOTE = _NoArrayMetadataStore()


def _pytree_handler() -> ocp.PyTreeCheckpointHandler:
    """Orbax's PyTree handler, writing plain zarr3 arrays (no OCDBT: each array is filled region by region)."""
    absl_logger = logging.getLogger("absl")  # orbax logs through absl, whose Python logger this is
    absl_logger.addFilter(_ARRAY_METADATA_NOTE)
    try:
        return ocp.PyTreeCheckpointHandler(
            use_ocdbt=False, use_zarr3=True, use_compression=False, type_handler_registry=_REGISTRY
        )
    finally:
        absl_logger.removeFilter(_ARRAY_METADATA_NOTE)


class _Saved(NamedTuple):
    """What a checkpoint item says of itself: the ``jax_mlp`` entry of its custom metadata, if any."""

    step: int | None
    has_master: bool


def _saved(directory: epath.Path) -> _Saved:
    try:
        metadata = ocp.PyTreeCheckpointHandler().metadata(directory)
    except FileNotFoundError as error:
        raise OffloadError(f"{directory} holds no orbax PyTree checkpoint ({error})") from error
    custom = (metadata.custom_metadata or {}).get(_METADATA_KEY)
    if custom is None:  # plain optax
        return _Saved(None, False)
    return _Saved(int(custom["step"]), bool(custom["master"]))


def _restore_item(expected: Any, master_dtype: Any, saved: _Saved) -> tuple[Any, Any]:
    """The tree to restore from the checkpoint, and the name of each of its leaves in ``expected``."""
    names = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(expected), partition.paths_of(expected))
    if master_dtype is None and saved.has_master:
        return {STATE: expected}, {STATE: names}
    if master_dtype is not None and not saved.has_master:
        return expected[STATE], names[STATE]
    return expected, names


def _open_arrays(directory: epath.Path, offloader: Offloader, params: Any, saved: _Saved) -> dict[str, Any]:
    """Opens the arrays to restore, keyed by their path in the offload's standard layout; reads nothing."""
    master_dtype = offloader.config.master_dtype
    item, names = _restore_item(standard_layout(offloader.inner, params, master_dtype), master_dtype, saved)
    restore = ocp.args.PyTreeRestore(
        item=item,
        restore_args=jax.tree.map(lambda _: ocp.type_handlers.RestoreArgs(restore_type=_StreamedLeaf), item),
        partial_restore=saved.has_master and master_dtype is None,
    )
    try:
        opened = _pytree_handler().restore(directory, args=restore)
    except (ValueError, KeyError) as error:
        raise OffloadError(
            f"checkpoint {directory} does not hold the state of this optimizer for these params ({error}); restore "
            "with the inner optimizer and params it was saved with"
        ) from error
    arrays = {}
    for name, want, array in zip(
        jax.tree.leaves(names),
        jax.tree.leaves(item),
        jax.tree.leaves(opened, is_leaf=lambda x: isinstance(x, ts.TensorStore)),
        strict=True,
    ):
        if tuple(array.shape) != tuple(want.shape):
            raise OffloadError(
                f"checkpoint {directory} holds {name} with shape {tuple(array.shape)}, but these params need "
                f"{tuple(want.shape)}; restore with the params it was saved with"
            )
        arrays[name] = array
    return arrays


def _host_block(value: Any, box: Box | None) -> np.ndarray:
    """``value[box]`` on the host; of a sharded array, from the addressable shard holding it (no gather)."""
    if box is None:
        return np.asarray(value)
    if isinstance(value, jax.Array) and len(value.sharding.device_set) > 1:
        for shard in value.addressable_shards:
            held = partition.shard_box(shard.index, value.shape)
            if all(lo <= start and stop <= hi for (start, stop), (lo, hi) in zip(box, held, strict=True)):
                offsets = tuple((start - lo, stop - lo) for (start, stop), (lo, _) in zip(box, held, strict=True))
                return np.asarray(shard.data)[slices(offsets)]
    return np.asarray(value)[slices(box)]


class _Restore:
    """The reads of one restore: each subgroup's record fields from the checkpoint's arrays."""

    def __init__(self, inner: optax.GradientTransformation, plan: Plan, arrays: dict[str, Any], params: Any):
        self.plan = plan
        self.layout = layout_of(inner, plan)
        self.arrays = [arrays.get(name) for name in self.layout.names]
        self.params = jax.tree.leaves(params)
        self.codes = quantized.int8_codes(jax.tree_util.tree_unflatten(self.layout.treedef, self.layout.leaves))

    def _master_from_params(self, region: Region, leaf: int) -> np.ndarray:
        return _host_block(self.params[leaf], region.box).astype(self.plan.master_dtype)

    def _check_codes(self, value: np.ndarray, region: Region) -> None:
        """Refuses int8 codes of an older format; only whole rows hold their blocks' words."""
        if value.ndim and value.shape[-1] == self.arrays[region.leaf].shape[-1]:
            quantized.check_int8_format(value, f"checkpoint array {self.layout.names[region.leaf]}")

    def load(self, index: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Subgroup ``index``'s state and master leaves, read from the checkpoint (or the params)."""
        subgroup = self.plan.subgroups[index]
        regions = self.layout.regions[index]
        fields = [*subgroup.layout.state_fields, *subgroup.layout.master_fields]
        reads = [None if self.arrays[r.leaf] is None else region_of(self.arrays[r.leaf], r).read() for r in regions]
        split = len(subgroup.layout.state_fields)
        values = []
        for i, (region, field, read) in enumerate(zip(regions, fields, reads, strict=True)):
            value = self._master_from_params(region, subgroup.pieces[i - split].leaf) if read is None else read.result()
            if field.dtype == remainders.REMAINDER_DTYPE and i >= split:
                value = remainders.split(np.asarray(value, np.float32))[1]
            if read is not None and self.codes[region.leaf]:
                self._check_codes(np.asarray(value), region)
            values.append(np.asarray(value).astype(field.dtype, copy=False))
        return values[:split], values[split:]


class OffloadCheckpointHandler(ocp.AsyncCheckpointHandler):
    """The orbax handler of :class:`OffloadSave` and :class:`OffloadRestore`.

    Orbax finds it through the args, so a ``CheckpointManager`` needs no ``item_handlers``. Saving
    flushes the offload and pins its step; the subgroups then stream out in the background while
    training goes on, and an update waits only to overwrite a record the save has not read yet.
    """

    async def async_save(self, directory: epath.Path, args: OffloadSave) -> list | None:
        """Starts saving ``args.offload`` at its current step; returns the futures that finish it."""
        offloader = _offloader_of(args.offload)
        pin = offloader.pin()
        try:
            stream = _SaveStream(offloader, pin, f"jax_mlp/save/{next(_SAVES)}/{directory}", args.params)
            has_master = offloader.plan.master_dtype is not None
            custom = {_METADATA_KEY: {"format": _FORMAT, "step": pin.step, "master": has_master}}
            save = ocp.args.PyTreeSave(stream.placeholders(), custom_metadata=custom)
            return await _pytree_handler().async_save(directory, args=save)
        except BaseException:
            pin.release()
            raise

    def save(self, directory: epath.Path, args: OffloadSave) -> None:
        """Saves ``args.offload`` at its current step; returns once the checkpoint is written."""

        async def save() -> list:
            return await self.async_save(directory, args) or []

        for future in asyncio.run(save()):
            future.result()

    def restore(self, directory: epath.Path, args: OffloadRestore | None = None) -> OffloadState:
        """Streams a checkpoint into the tiers of ``args.offload``, which it initialises.

        Returns:
          The :class:`~jax_mlp.OffloadState` at the restored step: the offload's part of the opt_state.
        """
        if args is None:
            raise OffloadError(
                f"restoring {directory} needs a new mlp_offload to restore into: pass "
                "jax_mlp.OffloadRestore(offload, params), or ocp.args.StandardRestore(...) for plain optax"
            )
        offloader = _offloader_of(args.offload)
        if offloader.plan is not None:
            raise OffloadError(
                "OffloadRestore needs a fresh mlp_offload, but this one is initialised; create a new one (on the same "
                "paths or empty ones) and do not call its init: the restore does"
            )
        saved = _saved(directory)
        abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(args.params))
        if offloader.config.master_dtype is not None and not saved.has_master and abstract:
            raise OffloadError(
                f"checkpoint {directory} has no master params, so the master copy starts from the params: pass the "
                "params' values, not their shapes, in OffloadRestore(params=...)"
            )
        arrays = _open_arrays(directory, offloader, args.params, saved)
        step = args.step if args.step is not None else saved.step or 0

        plan = offloader.plan_for(args.params)
        return offloader.init_from(args.params, step, _Restore(offloader.inner, plan, arrays, args.params).load)

    def metadata(self, directory: epath.Path) -> Any:
        """The item's orbax tree metadata: the shapes and dtypes of the standard layout."""
        return ocp.PyTreeCheckpointHandler().metadata(directory)


ocp.args.register_with_handler(OffloadCheckpointHandler, for_save=True)(OffloadSave)
ocp.args.register_with_handler(OffloadCheckpointHandler, for_restore=True)(OffloadRestore)


def restore_params(offload: OffloadTransformation | Offloader, params_like: Any) -> Any:
    """The params at the offload's step, from its master copy in the tiers: resume after a crash.

    Each leaf is ``master.astype(param dtype)``, which is exactly what training had applied, so a
    run resumed with ``mlp_offload(..., resume=True)`` needs no checkpoint. Reads stream subgroup by
    subgroup; the result takes the params' memory once.

    Args:
      offload: an initialised ``mlp_offload`` with ``master_dtype`` (typically just resumed).
      params_like: the params' tree of arrays or ``jax.ShapeDtypeStruct``s: structure, shapes, dtypes
        and, if present, shardings of the result.

    Returns:
      The params, as jax arrays placed like ``params_like`` (default device if it has no sharding).
    """
    offloader = _offloader_of(offload)
    plan = offloader.plan
    if plan is None:
        raise OffloadError("restore_params needs an initialised mlp_offload: create it with resume=True and call init")
    if plan.master_dtype is None:
        raise OffloadError(
            "this mlp_offload keeps no master params (master_dtype=None), so the tiers cannot give the params back; "
            "restore them from a checkpoint"
        )
    if any(any(remainders.held_as_remainders(sg.layout.master_fields)) for sg in plan.subgroups):
        raise OffloadError(
            "this mlp_offload keeps its fp32 masters as remainders (master_storage='remainder'): the tiers hold "
            "only their low halves, the params being the high halves, so they cannot give the params back; restore "
            "the params from your checkpoint, or run with master_storage='full' to resume from the tiers alone"
        )
    likes = check_tree(plan, params_like, "params_like", check_dtype=True)
    blocks: dict[tuple[int, Box | None], np.ndarray] = {}  # by leaf and owned shard's box (None: on one device)

    def convert(index: int, fetched: tuple) -> None:
        for piece, master in zip(plan.subgroups[index].pieces, fetched[1], strict=True):
            spec = plan.leaves[piece.leaf]
            value = np.asarray(jnp.asarray(master).astype(spec.dtype))
            key = (piece.leaf, None if piece.shard is None else piece.shard.box)
            if piece.rows is None:
                blocks[key] = value
            else:
                shape = spec.shape if piece.shard is None else piece.shard.shape
                blocks.setdefault(key, np.empty(shape, value.dtype))[piece.rows[0] : piece.rows[1]] = value

    pin = offloader.pin()
    config = offloader.config
    engine = Engine(config.prefetch_depth, config.write_depth, config.io_timeout)
    try:
        engine.run(range(len(plan.subgroups)), lambda k: offloader.read_pinned(pin, k), convert, lambda *_: None)
    finally:
        engine.close()
        pin.release()
    placed = [
        _placed(index, spec.shape, offloader.sharding.shardings[index], getattr(like, "sharding", None), blocks)
        for index, (spec, like) in enumerate(zip(plan.leaves, likes, strict=True))
    ]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params_like), placed)


def _placed(
    index: int,
    shape: tuple[int, ...],
    sharding: jax.sharding.Sharding | None,
    target: jax.sharding.Sharding | None,
    blocks: dict[tuple[int, Box | None], np.ndarray],
) -> jax.Array:
    """Leaf ``index`` as a jax array placed with ``target``, from its host blocks (sharded as at ``init``)."""
    if sharding is None:
        return jax.device_put(blocks[index, None], target)
    array = jax.make_array_from_callback(shape, sharding, lambda at: blocks[index, partition.shard_box(at, shape)])
    return array if target is None or target == sharding else jax.device_put(array, target)
