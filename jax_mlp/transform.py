"""``mlp_offload``: the optax face of the offloaded optimizer.

The user holds only :class:`OffloadState`, a step counter. The inner optimizer's state lives in the
tiers, one record per subgroup, and each ``update`` streams it through the device subgroup by
subgroup: fetch, ``device_put``, the jitted inner update on the subgroup's view, back to host, store.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import itertools
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_mlp import in_jit, partition, peers
from jax_mlp.config import OffloadConfig, Path, parse_rate
from jax_mlp.engine import Engine, Timings
from jax_mlp.model import PathSpeed
from jax_mlp.partition import Plan, Subgroup
from jax_mlp.probe import probe
from jax_mlp.scheduler import Scheduler
from jax_mlp.stats import IOCounters, StatsLog, UpdateStats, compiles_on_this_thread, fan_out
from jax_mlp.tiers import (
    HEADER_SIZE,
    HostCache,
    OffloadError,
    Pin,
    RecordCodec,
    RecordError,
    TierStack,
    new_record,
    open_path,
    payload_of,
    seal,
)

_RUN_FORMAT = 1
_INSTANCES = itertools.count()  # names this process's offloaders alike in every process, for barriers
logger = logging.getLogger(__name__)


class OffloadState(NamedTuple):
    """The whole optimizer state the user holds: the number of updates applied so far.

    The inner optimizer's state is in the tiers; ``step`` ties this handle to the step they hold.
    """

    step: jax.Array


def _as_arrays(tree: Any) -> Any:
    """Strips flax NNX ``Variable`` wrappers, as ``nnx.Optimizer`` does before ``tx.update``.

    ``nnx.Optimizer`` calls ``init`` on a state of Variables but ``update`` on plain arrays; the plan
    is made on the arrays so both calls see one tree. flax is only consulted if already imported.
    """
    nnx = sys.modules.get("flax.nnx")
    return nnx.as_pure(tree) if nnx is not None and hasattr(nnx, "as_pure") else tree


def _check_supported(params: Any) -> None:
    """Refuses a tree with no leaves: there would be nothing to offload."""
    if not jax.tree_util.tree_leaves(params):
        raise ValueError("params has no leaves: there is no optimizer state to offload")


def _blocks_by_device(leaves: Sequence[jax.Array], shardings: Sequence[Any]) -> list[dict[int | None, jax.Array]]:
    """Per leaf, its data on each device that holds a block of it (``None``: a leaf on one device).

    A leaf that arrives with another sharding than at ``init`` is first resharded to that one, shard
    to shard, so each block is found on the device that owns its state.
    """
    blocks = []
    for leaf, sharding in zip(leaves, shardings, strict=True):
        if sharding is None:
            blocks.append({None: leaf})
            continue
        if not leaf.sharding.is_equivalent_to(sharding, leaf.ndim):
            leaf = jax.device_put(leaf, sharding)
        blocks.append({shard.device.id: shard.data for shard in leaf.addressable_shards})
    return blocks


def _assemble(
    shape: tuple[int, ...], sharding: jax.sharding.Sharding, owners: dict[jax.Device, int], owned: dict[int, jax.Array]
) -> jax.Array:
    """A sharded leaf's updates from the owners' blocks; replicas get a device-to-device copy.

    Args:
      shape: the leaf's global shape.
      sharding: the leaf's sharding, as at ``init``.
      owners: from :func:`partition.block_owners`.
      owned: each owned block's update, by its owner's device id.

    Returns:
      A ``jax.Array`` with ``sharding``; no device ever holds more than its own block.
    """
    arrays = []
    for device, owner in owners.items():
        block = owned[owner]
        arrays.append(block if block.devices() == {device} else jax.device_put(block, device))
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


_DEFAULT_BANDWIDTH = 1e9
_INIT_PROBE_BYTES = 64 * 1024**2


def _starting_speed(path: Path, run_probe: bool) -> PathSpeed:
    """A path's bandwidths before any update: declared, else probed (if asked), else its caps.

    With none of these, every path starts equal; measurement while running corrects it.
    """
    read, write = path.read_bandwidth, path.write_bandwidth
    if (read is None or write is None) and run_probe:
        measured = probe(path, total_bytes=_INIT_PROBE_BYTES)
        read, write = read or measured.read_bandwidth, write or measured.write_bandwidth
    read = read or path.max_read or write or path.max_write or _DEFAULT_BANDWIDTH
    write = write or path.max_write or read
    return PathSpeed(path.name, read, write)


def _is_tracer(tree: Any) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(tree))


def _placement(leaves: Sequence[jax.Array], shardings: Sequence[Any]) -> jax.Device | None:
    """Where subgroups of leaves on one device go: that device if committed, else None (uncommitted).

    Uncommitted inputs give uncommitted updates, so the user's params keep their commitment and
    their jitted step does not recompile. Subgroups of sharded leaves run where their shards are.
    """
    first = next((x for x, sharding in zip(leaves, shardings, strict=True) if sharding is None), None)
    return next(iter(first.devices())) if first is not None and first.committed else None


class _SubgroupSpec(NamedTuple):
    """Everything a subgroup's computation depends on besides its input arrays (a jit static arg).

    Pieces are normalised to start at row 0 (the real start is a traced argument) and lose their
    shard (their arrays are the shard's block), so the chunks of one leaf share a compilation.
    """

    inner: optax.GradientTransformation
    treedef: Any
    num_leaves: int
    pieces: tuple[partition.Piece, ...]
    dtypes: tuple[np.dtype, ...]
    state_treedef: Any
    master_dtype: np.dtype | None

    @classmethod
    def of(cls, inner: optax.GradientTransformation, plan: Plan, subgroup: Subgroup) -> _SubgroupSpec:
        pieces = tuple(
            partition.Piece(p.leaf, None if p.rows is None else (0, p.rows[1] - p.rows[0])) for p in subgroup.pieces
        )
        dtypes = tuple(plan.master_dtype or plan.leaves[p.leaf].dtype for p in pieces)
        return cls(
            inner, plan.treedef, len(plan.leaves), pieces, dtypes, subgroup.layout.state_treedef, plan.master_dtype
        )

    def view(self, values: Sequence[Any]) -> Any:
        return partition.view_of(self.treedef, self.num_leaves, self.pieces, values)


class _Executables:
    """Compiled subgroup programs, shared by every subgroup whose lowered program is the same.

    The views of identical blocks lower to the same program (the positions of their ``None``
    leaves leave no trace in it), so a model of 24 identical blocks compiles once, not 24 times.
    Lowering is cheap; XLA compilation is what this saves. Both maps are bounded LRUs.
    """

    def __init__(self, capacity: int = 1024):
        self._capacity = capacity
        self._by_signature: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self._by_program: collections.OrderedDict[Any, Any] = collections.OrderedDict()

    def _remember(self, table: collections.OrderedDict, key: Any, value: Any) -> None:
        table[key] = value
        table.move_to_end(key)
        if len(table) > self._capacity:
            table.popitem(last=False)

    def __call__(self, function: Any, spec: _SubgroupSpec, *args: Any) -> Any:
        """Runs ``function(spec, *args)`` through a shared executable."""
        leaves, structure = jax.tree_util.tree_flatten(args)
        # An executable runs only on the device it was compiled for.
        signature = (spec, structure, leaves[0].sharding, tuple((x.shape, x.dtype) for x in leaves))
        executable = self._by_signature.get(signature)
        if executable is None:
            lowered = function.lower(spec, *args)
            # The text leaves out arguments the program never reads, so the shapes join the key.
            program = (hashlib.sha256(lowered.as_text().encode()).hexdigest(), signature[1:])
            executable = self._by_program.get(program) or lowered.compile()
            self._remember(self._by_program, program, executable)
            self._remember(self._by_signature, signature, executable)
        return executable(*args)


_EXECUTABLES = _Executables()


def _record_codec(plan: Plan) -> RecordCodec:
    """Packs a subgroup's (state leaves, master leaves) into a sealed record by its layout, and back."""

    def pack(index: int, fields: tuple, step: int) -> np.ndarray:
        layout = plan.subgroups[index].layout
        record = new_record(layout.nbytes, zeroed=False)  # pack and seal write every byte
        partition.pack(layout, *fields, payload_of(record))
        seal(record, step, plan.layout_hash)
        return record

    def unpack(index: int, payload: np.ndarray) -> tuple:
        return partition.unpack(plan.subgroups[index].layout, payload)

    return RecordCodec(pack, unpack)


def _slice_rows(leaf: jax.Array, start: jax.Array, piece: partition.Piece) -> jax.Array:
    if piece.rows is None:
        return leaf
    return jax.lax.dynamic_slice_in_dim(leaf, start, piece.rows[1], axis=0)


@functools.partial(jax.jit, static_argnums=0)
def _subgroup_init(spec: _SubgroupSpec, params: Sequence[jax.Array], starts: Sequence[jax.Array]) -> tuple:
    """The inner optimizer's initial state (and master params) for one subgroup."""
    pieces = [_slice_rows(x, s, p) for x, s, p in zip(params, starts, spec.pieces, strict=True)]
    if spec.master_dtype is not None:
        pieces = [x.astype(spec.master_dtype) for x in pieces]
    state = spec.inner.init(spec.view(pieces))
    return jax.tree_util.tree_leaves(state), pieces if spec.master_dtype is not None else []


@functools.partial(jax.jit, static_argnums=0, donate_argnums=6)
def _subgroup_update(
    spec: _SubgroupSpec,
    grads: Sequence[jax.Array],
    params: Sequence[jax.Array] | None,
    starts: Sequence[jax.Array],
    state_leaves: Sequence[jax.Array],
    master_leaves: Sequence[jax.Array],
    accumulators: Sequence[jax.Array | None],
) -> tuple:
    """One subgroup's inner update on its view.

    Gradients are up-cast here to the dtype the optimizer works in (the master dtype, or the
    param dtype). ``params`` may be None (no master) when the inner optimizer needs none. Updates
    of a row chunk are written into its leaf's accumulator in place.

    Returns:
      Per piece, its update (or its updated accumulator); the new state leaves; the new master leaves.
    """
    grad_pieces = [
        _slice_rows(g, s, p).astype(d) for g, s, p, d in zip(grads, starts, spec.pieces, spec.dtypes, strict=True)
    ]
    param_pieces = (
        None if params is None else [_slice_rows(x, s, p) for x, s, p in zip(params, starts, spec.pieces, strict=True)]
    )
    if spec.master_dtype is not None:
        inner_params = spec.view(master_leaves)
    else:
        inner_params = None if param_pieces is None else spec.view(param_pieces)
    state = jax.tree_util.tree_unflatten(spec.state_treedef, state_leaves)
    updates, new_state = spec.inner.update(spec.view(grad_pieces), state, inner_params)
    update_pieces = jax.tree_util.tree_leaves(updates)
    if spec.master_dtype is not None:
        new_master = [optax.apply_updates(m, u) for m, u in zip(master_leaves, update_pieces, strict=True)]
        # In fp32, p + (m_lowp - p) == m_lowp: apply_updates then yields exactly the master's cast.
        user_updates = [
            m.astype(p.dtype).astype(m.dtype) - p.astype(m.dtype) for m, p in zip(new_master, param_pieces, strict=True)
        ]
    else:
        new_master = []
        user_updates = [u.astype(d) for u, d in zip(update_pieces, spec.dtypes, strict=True)]
    outputs = [
        u if piece.rows is None else jax.lax.dynamic_update_slice_in_dim(acc, u, start, axis=0)
        for piece, start, u, acc in zip(spec.pieces, starts, user_updates, accumulators, strict=True)
    ]
    return outputs, jax.tree_util.tree_leaves(new_state), new_master


class _Step:
    """One update in progress: what to restore if it fails, and what it has measured so far."""

    def __init__(self, step: int, prefetched: dict, locations: dict, moved: list, background_wait: float):
        self.step, self.prefetched, self.locations, self.moved = step, prefetched, locations, moved
        self.background_wait = background_wait
        self.timings = Timings(0.0, 0.0, 0.0, 0.0)
        self.compiles = 0


class Offloader:
    """The live object behind ``mlp_offload``: plan, tiers, engine and compiled functions.

    Use it through the ``optax.GradientTransformationExtraArgs`` that :func:`mlp_offload` returns;
    keep a reference to that object to read ``stats`` and to ``close()`` it.
    """

    def __init__(
        self,
        inner: optax.GradientTransformation,
        config: OffloadConfig,
        *,
        resume: bool = False,
        on_stats: Callable[[UpdateStats], None] | None = None,
    ):
        self.inner = inner
        self.config = config
        self.resume = resume
        self.on_stats = on_stats
        self.plan: Plan | None = None
        self.step = 0
        self.last_stats: UpdateStats | None = None
        self._specs: dict[int, _SubgroupSpec] = {}
        self._shardings: list[jax.sharding.Sharding | None] = []
        self._shards: list[tuple[partition.Shard, ...] | None] = []
        self._devices = {device.id: device for device in jax.devices()}
        self._jit_layout: in_jit.JitLayout | Exception | None = None
        self._jit_owners: dict[int, list[tuple[int, int | None]]] = {}
        self._rendezvous: in_jit.Rendezvous | None = None
        self._jit_failure: str | None = None
        self._run_key = f"jax_mlp/{next(_INSTANCES)}"
        self._prefetched: dict[int, Future] = {}
        self._total_compiles = 0
        self._tiers: TierStack | None = None
        self._engine: Engine | None = None
        self._scheduler: Scheduler | None = None
        self._counters: IOCounters | None = None
        self._closed = False

    # ----------------------------------------------------------------------------- lifecycle

    def _run_identity(self) -> dict:
        plan = self.plan
        return {
            "format": _RUN_FORMAT,
            "layout_hash": plan.layout_hash.hex(),
            "num_subgroups": len(plan.subgroups),
            "state_bytes": plan.state_nbytes,
        }

    def _open_tiers(self) -> None:
        """Opens the paths and checks what they hold against ``resume``; writes nothing yet."""
        config = self.config
        paths = [
            open_path(p, jax.process_index(), max_inflight=config.max_inflight, node_lock=config.node_lock)
            for p in config.paths
        ]
        expected = self._run_identity()["layout_hash"]
        found = {path.root: path.read_run_file() for path in paths}
        for root, identity in found.items():
            if identity is not None and not self.resume:
                raise OffloadError(
                    f"path {root} already holds offloaded optimizer state; pass resume=True to continue that run, "
                    "or give an empty directory"
                )
            if identity is not None and identity.get("layout_hash") != expected:
                raise RecordError(
                    f"path {root} holds state of another run or subgroup layout (layout hash "
                    f"{identity.get('layout_hash')}, expected {expected}); resume with the same params, optimizer "
                    "and subgroup_size, or give an empty directory"
                )
        if self.resume and not any(found.values()):
            raise OffloadError(
                f"resume=True, but no path in {list(found)} holds offloaded optimizer state; check the paths, "
                "or start a new run without resume"
            )
        self._scheduler = Scheduler(
            [HEADER_SIZE + sg.layout.nbytes for sg in self.plan.subgroups],
            [_starting_speed(p, config.probe) for p in config.paths],
            order=config.order,
            placement=config.placement,
            rebalance=config.rebalance,
        )
        self._counters = IOCounters([p.root for p in paths])
        self._tiers = TierStack(
            HostCache(self.config.host_cache),
            paths,
            self.plan.layout_hash,
            self._scheduler.path_of,
            self._counters,
            _record_codec(self.plan),
        )
        self._engine = Engine(self.config.prefetch_depth, self.config.write_depth, self.config.io_timeout)

    def init(self, params: Any) -> OffloadState:
        """Plans the subgroups and streams the inner optimizer's initial state out to the tiers.

        With ``resume=True`` it reopens the tiers at their last complete step instead. The paths are
        marked as holding this run (``run.json``) only once that has succeeded, so a failed ``init``
        can simply be retried.
        """
        if self.resume:
            return self._initialise(params, self._find_last_complete_step)
        return self._initialise(params, functools.partial(self._write_initial_state, params))

    def init_from(self, params: Any, step: int, loader: Callable[[Plan], Callable[[int], tuple]]) -> OffloadState:
        """Like :meth:`init`, but the tiers start at ``step`` with a given state (a checkpoint restore).

        Args:
          params: the params, or their ``jax.ShapeDtypeStruct``s: only shapes and dtypes are used.
          step: the step the restored state is at.
          loader: called with the plan; returns a function that maps a subgroup index to its state
            leaves and master leaves (numpy arrays shaped as in its record layout). That function is
            called once per subgroup, on reader threads.

        Returns:
          The :class:`OffloadState` at ``step``.
        """
        if self.resume:
            raise OffloadError("init_from writes a fresh state: create the mlp_offload without resume=True")
        return self._initialise(params, lambda: self._write_restored_state(step, loader(self.plan)))

    def _initialise(self, params: Any, populate: Callable[[], int]) -> OffloadState:
        """Plans, opens the tiers, fills them with ``populate`` (which returns their step), marks the paths."""
        if _is_tracer(params):
            raise OffloadError(
                "mlp_offload(...).init was called inside a jax transformation (jit, eval_shape, ...); call init "
                "eagerly on concrete params: it writes the initial optimizer state to storage"
            )
        if self.plan is not None:
            raise OffloadError("this mlp_offload was already initialised; create a new one for another model")
        self._check_open()
        params = _as_arrays(params)
        _check_supported(params)
        leaves = jax.tree_util.tree_leaves(params)
        self._shards = [partition.owned_shards(x) for x in leaves]
        self._shardings = [
            None if shards is None else x.sharding for x, shards in zip(leaves, self._shards, strict=True)
        ]
        self.plan = partition.make_plan(
            params, self.inner, self.config.subgroup_size, self.config.master_dtype, self._shards
        )
        try:
            self._jit_layout = in_jit.jit_layout([spec.path for spec in self.plan.leaves], leaves)
        except ValueError as error:  # raised only if update is ever traced inside jit
            self._jit_layout = error
        else:
            self._jit_owners = self._owners_by_device(self._jit_layout.mesh)
            self._rendezvous = in_jit.Rendezvous(len(self._jit_layout.mesh.local_devices), self.config.peer_timeout)
        try:
            self._open_tiers()
            self.step = populate()
            for path in self._tiers.paths:
                path.write_run_file(self._run_identity())
            if jax.process_count() > 1:
                peers.barrier(f"{self._run_key}/init", self.config.peer_timeout, "the end of init")
        except BaseException:
            if self._engine is not None:
                self._engine.close()
            self.plan = self._tiers = self._engine = None
            raise
        return OffloadState(jnp.asarray(self.step, jnp.int32))

    def _write_initial_state(self, params: Any) -> int:
        plan = self.plan
        param_leaves = [jnp.asarray(x) for x in jax.tree_util.tree_leaves(params)]
        device = _placement(param_leaves, self._shardings)
        blocks = _blocks_by_device(param_leaves, self._shardings)

        def compute(index: int, _: None) -> tuple:
            subgroup = plan.subgroups[index]
            leaves = [blocks[p.leaf][p.device] for p in subgroup.pieces]
            starts = self._starts(subgroup, self._device_of(subgroup, device))
            return _EXECUTABLES(_subgroup_init, self._spec(subgroup), leaves, starts)

        return self._populate(0, lambda _: None, compute)

    def _write_restored_state(self, step: int, load: Callable[[int], tuple]) -> int:
        return self._populate(step, load, lambda _, loaded: loaded)

    def _populate(self, step: int, fetch: Callable[[int], Any], compute: Callable[[int, Any], tuple]) -> int:
        """Streams a whole state at ``step`` into the tiers through the pipeline; returns ``step``.

        Records go out in the order of step ``step - 1``, so the cache keeps what step ``step``
        updates first.
        """
        compiles = compiles_on_this_thread()
        self.step = step  # the cache and idle-time prefetch started by _finish work at this step
        order = self._scheduler.order(step - 1)
        timings = self._engine.run(order, fetch, compute, lambda k, out: self._store(k, out, step))
        self._finish(step, timings, compiles_on_this_thread() - compiles)
        self._engine.wait_background()
        return step

    def _find_last_complete_step(self) -> int:
        """The highest step at which every subgroup has a verified record on some path.

        With several processes, the highest such step that every process has: a process that
        finished one more update than a dead peer resumes one step back, from its other slot.
        """
        plan, tiers = self.plan, self._tiers
        found: dict[int, dict[int, int]] = {}

        def scan(index: int) -> dict[int, int]:
            steps = {}
            for path_index, path in enumerate(tiers.paths):
                for slot in (0, 1):
                    step = path.verified_step(index, slot, plan.layout_hash)
                    if step is not None:
                        steps[step] = path_index
            return steps

        self._engine.run(range(len(plan.subgroups)), scan, found.__setitem__, lambda *_: None)
        common = set.intersection(*(set(steps) for steps in found.values()))
        if jax.process_count() > 1:
            published = peers.all_values(
                f"{self._run_key}/resume", json.dumps(sorted(common)), self.config.peer_timeout, "resume"
            )
            common = common.intersection(*(json.loads(value) for value in published))
        if not common:
            raise RecordError(
                f"no step has a complete, verified record of every subgroup on paths {list(self.config.paths)}; "
                "the tiers cannot be resumed: restore from a checkpoint"
            )
        step = max(common)
        for index, steps in found.items():
            tiers.locations[index] = steps[step]
        return step

    def _check_open(self) -> None:
        if self._closed:
            raise OffloadError("this mlp_offload is closed; create a new one (with resume=True to continue)")

    def flush(self) -> None:
        """Writes every dirty cached record to storage, so the tiers alone hold the newest step."""
        self._check_open()
        if self._tiers is None:
            return
        self._write_back_dirty()
        self._engine.wait_background()
        self._tiers.drop_moved()

    def pin(self) -> Pin:
        """Flushes, then pins the current step so it can be read beside training (a checkpoint save).

        A pinned record stays until :meth:`read_pinned` has read it or the pin is released: only a
        write or move that would overwrite or delete such a record waits (at most ``io_timeout``).

        Returns:
          The :class:`~jax_mlp.tiers.Pin`; call its ``release()`` when done, also on failure.
        """
        if self.plan is None:
            raise OffloadError("this mlp_offload has not been initialised: call init (or restore a checkpoint) first")
        self.flush()
        return self._tiers.pin(self.step, self.config.io_timeout)

    def read_pinned(self, pin: Pin, index: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Subgroup ``index``'s state leaves and master leaves at the pinned step, verified, then unpinned.

        The arrays are views of a record that nothing writes to again. Safe to call from any thread.
        """
        return self._tiers.read_pinned(pin, index)

    def set_caps(self, path: int | str, *, max_read: float | str | None = None, max_write: float | str | None = None):
        """Changes a path's bandwidth caps while training runs (e.g. to keep a shared PFS polite).

        Args:
          path: the path's index in ``paths``, or its name.
          max_read: the new read cap, e.g. ``"100MB/s"``; None removes it.
          max_write: the new write cap; None removes it.
        """
        stores = self._tiers.paths
        index = path if isinstance(path, int) else [s.root for s in stores].index(path)
        stores[index].traffic.bucket.set_caps(
            parse_rate(max_read, name="max_read"), parse_rate(max_write, name="max_write")
        )

    @property
    def scheduler(self) -> Scheduler:
        """The live placement and order policy (``placement``, ``speeds``, ``moves``)."""
        return self._scheduler

    def close(self, *, delete: bool = False) -> None:
        """Waits for queued jitted updates, flushes, stops the threads and, if ``delete``, removes the files."""
        if self._closed:
            return
        self._settle_jitted_updates()
        try:
            if not delete:
                self.flush()
        finally:
            self._closed = True
            if self._engine is not None:
                self._engine.settle(self._prefetched.values())
                self._engine.close()
            if self._tiers is not None:
                self._tiers.cache.clear()
                if delete:
                    for path in self._tiers.paths:
                        path.remove()

    def _settle_jitted_updates(self) -> None:
        """Waits for the jitted updates still queued on the devices, so none meets closed tiers.

        A failed one has raised in its own results already; here it only must not stop the close.
        """
        if self._rendezvous is None:
            return
        try:
            jax.effects_barrier()
        except Exception:
            logger.debug("a jitted update failed before close; its results carry the error", exc_info=True)

    def __enter__(self) -> Offloader:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # ----------------------------------------------------------------------------- update

    def _spec(self, subgroup: Subgroup) -> _SubgroupSpec:
        spec = self._specs.get(subgroup.index)
        if spec is None:
            spec = self._specs[subgroup.index] = _SubgroupSpec.of(self.inner, self.plan, subgroup)
        return spec

    def _device_of(self, subgroup: Subgroup, placement: jax.Device | None) -> jax.Device | None:
        """The device a subgroup's update runs on: its shards' device, or ``placement`` for whole leaves."""
        device_id = subgroup.pieces[0].device
        return placement if device_id is None else self._devices[device_id]

    def _starts(self, subgroup: Subgroup, device: jax.Device | None) -> list:
        return [jax.device_put(np.int32(0 if p.rows is None else p.rows[0]), device) for p in subgroup.pieces]

    def _store(self, index: int, computed: tuple, step: int) -> None:
        """Writer thread: the device results to host arrays (no copy on CPU), then into the tiers."""
        fields = tuple([np.asarray(x) for x in leaves] for leaves in computed[-2:])
        self._tiers.store(index, fields, HEADER_SIZE + self.plan.subgroups[index].layout.nbytes, step)

    def _finish(self, step: int, timings: Timings, compiles: int, extra_wait: float = 0.0) -> None:
        counters = self._counters
        self._total_compiles += compiles
        started = time.perf_counter() - timings.total - extra_wait
        stored = collections.Counter(self._tiers.locations.values())
        self._scheduler.observe([path.traffic.take_usage() for path in self._tiers.paths])
        self.last_stats = UpdateStats(
            step=step,
            seconds=timings.total + extra_wait,
            read_wait_s=timings.read_wait,
            compute_s=timings.compute,
            write_wait_s=timings.write_wait + extra_wait,
            bytes_read=dict(counters.bytes_read),
            bytes_written=dict(counters.bytes_written),
            cache_hits=counters.cache_hits,
            cache_misses=counters.cache_misses,
            compiles=compiles,
            total_compiles=self._total_compiles,
            events=counters.events_since(started),
            placement={path.root: stored[i] for i, path in enumerate(self._tiers.paths)},
            bandwidth={
                path.root: {"read": speed.read_bandwidth, "write": speed.write_bandwidth}
                for path, speed in zip(self._tiers.paths, self._scheduler.speeds, strict=True)
            },
        )
        counters.reset()  # idle-time I/O started below counts towards the next update
        if self.config.flush == "idle":
            self._write_back_dirty()
        if self.config.idle_prefetch:
            self._prefetch_next()
        if self.on_stats is not None:
            try:
                self.on_stats(self.last_stats)
            except Exception:  # a logging failure must not desynchronise the step from the tiers
                logger.exception("the on_stats callback of mlp_offload raised; training goes on")

    def _prefetch_next(self) -> None:
        """Starts reading the next update's first uncached records while forward and backward run."""
        for index in self._scheduler.order(self.step):
            if len(self._prefetched) >= self.config.prefetch_depth:
                return
            if not self._tiers.cache.holds(index, self.step):
                self._prefetched[index] = self._engine.read_ahead(self._tiers.fetch, index, self.step)

    def _write_back_dirty(self) -> None:
        """Queues every dirty cached record for writing on the writer threads (idle-time I/O)."""
        for subgroup, entry in self._tiers.cache.dirty():
            self._engine.submit_background(self._tiers.write_back, subgroup, entry)

    def _leaf_updates(self, results: dict[tuple[int, int | None], jax.Array]) -> list[jax.Array]:
        """Each leaf's update: its one block, or its owned blocks assembled with the leaf's sharding."""
        leaves = []
        for index, (spec, sharding, shards) in enumerate(
            zip(self.plan.leaves, self._shardings, self._shards, strict=True)
        ):
            if sharding is None:
                leaves.append(results[index, None])
            else:
                owners = partition.block_owners(spec.shape, sharding, shards)
                owned = {shard.device: results[index, shard.device] for shard in shards}
                leaves.append(_assemble(spec.shape, sharding, owners, owned))
        return leaves

    def _check_state(self, state: Any) -> None:
        if not isinstance(state, OffloadState):
            raise TypeError(
                f"mlp_offload.update expects the OffloadState returned by its init, got {type(state).__name__}"
            )
        if self.plan is None:
            raise OffloadError("mlp_offload.update was called before init")
        self._check_open()

    def _check_step(self, step: int) -> None:
        if step != self.step:
            raise OffloadError(
                f"the opt_state passed to update is at step {step}, but the offloaded state is at step {self.step}; "
                "offloaded state cannot go back in time: pass the opt_state returned by the previous update, "
                "or restore a checkpoint"
            )

    def _check_tree(self, tree: Any, name: str, *, check_dtype: bool) -> list:
        plan = self.plan
        path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        if treedef != plan.treedef:
            names = {jax.tree_util.keystr(p) for p, _ in path_leaves}
            expected = {spec.path for spec in plan.leaves}
            missing, extra = sorted(expected - names), sorted(names - expected)
            detail = f"missing leaves {missing[:5]}" if missing else ""
            detail += ("; " if detail and extra else "") + (f"unexpected leaves {extra[:5]}" if extra else "")
            raise ValueError(
                f"the {name} tree does not match the params tree given to init: {detail or 'the containers differ'}. "
                f"Pass {name} with exactly the structure of the params"
            )
        leaves = []
        for (_, leaf), spec in zip(path_leaves, plan.leaves, strict=True):
            shape = tuple(np.shape(leaf))
            if shape != spec.shape:
                raise ValueError(
                    f"{name} leaf {spec.path} has shape {shape}, but the param had shape {spec.shape} at init"
                )
            dtype = np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
            if check_dtype and dtype != spec.dtype:
                raise ValueError(
                    f"{name} leaf {spec.path} has dtype {dtype}, but the param had dtype {spec.dtype} at init; the "
                    "offloaded state was laid out for that dtype: keep it, or start a new run"
                )
            if not jnp.issubdtype(dtype, jnp.inexact):
                raise ValueError(
                    f"{name} leaf {spec.path} has dtype {dtype}; only floating-point leaves can be optimized"
                )
            leaves.append(jnp.asarray(leaf))
        return leaves

    def _check_inputs(self, updates: Any, params: Any) -> tuple[list, list | None]:
        """The grad and param leaves, checked against the plan (concrete arrays or tracers)."""
        updates, params = _as_arrays(updates), _as_arrays(params)
        grads = self._check_tree(updates, "grads", check_dtype=False)
        if params is None and self.plan.master_dtype is not None:
            raise ValueError("mlp_offload with master_dtype needs params: call tx.update(grads, opt_state, params)")
        return grads, None if params is None else self._check_tree(params, "params", check_dtype=True)

    def _out_dtype(self, leaf: int) -> np.dtype:
        """The dtype of a leaf's updates: the master dtype if there is one, else the param's."""
        master = self.plan.master_dtype
        return np.dtype(master) if master is not None else self.plan.leaves[leaf].dtype

    def _begin_step(self) -> _Step:
        """Settles idle-time I/O and remembers what to restore if the update fails."""
        background_wait = self._engine.wait_background()
        if self.config.flush == "idle":
            self._tiers.drop_moved()
        prefetched, self._prefetched = self._prefetched, {}
        tiers = self._tiers
        return _Step(self.step, prefetched, dict(tiers.locations), list(tiers.moved), background_wait)

    def _abort_step(self, run: _Step) -> None:
        """Step ``run.step`` is intact in the other slot: forgets every trace of the unfinished one."""
        self._tiers.cache.discard_unless_step(run.step)
        self._tiers.locations, self._tiers.moved = run.locations, run.moved
        self._engine.settle(run.prefetched.values())

    def _stream(
        self,
        run: _Step,
        order: Sequence[int],
        grad_of: Callable[[partition.Piece], jax.Array],
        param_of: Callable[[partition.Piece], jax.Array] | None,
        device_of: Callable[[Subgroup], jax.Device | None],
        *,
        in_callback: bool = False,
    ) -> dict[tuple[int, int | None], jax.Array]:
        """Streams the subgroups in ``order`` through their devices, storing their step ``run.step + 1``.

        Args:
          run: the update in progress; it takes the stream's timings and compile count.
          order: the subgroups to update, in order.
          grad_of: a piece's gradient block (the whole leaf, or its shard).
          param_of: the same for params, or None when the update needs no params.
          device_of: where a subgroup's update runs.
          in_callback: streaming inside a device's host callback. A CPU device then runs only work
            that its callback's own thread puts on it and waits for: transfers and results stay on
            this thread.

        Returns:
          Each piece's update block, by (leaf, device id).
        """
        plan, step = self.plan, run.step
        accumulators: dict[tuple[int, int | None], jax.Array] = {}
        results: dict[tuple[int, int | None], jax.Array] = {}

        def fetch(index: int) -> list:
            subgroup = plan.subgroups[index]
            early = run.prefetched.pop(index, None)
            if early is not None:
                fields = self._engine.result(early, f"reading subgroup {index} ahead")
            else:
                fields = self._tiers.fetch(index, step)
            return fields if in_callback else jax.device_put(fields, device_of(subgroup))

        def compute(index: int, fetched: list) -> tuple:
            started = time.perf_counter()
            subgroup = plan.subgroups[index]
            device = device_of(subgroup)
            state_leaves, master_leaves = jax.device_put(fetched, device) if in_callback else fetched
            for p in subgroup.pieces:
                if p.rows is not None and (p.leaf, p.device) not in accumulators:
                    block_shape = partition.piece_shape(plan.leaves[p.leaf], p._replace(rows=None))
                    accumulators[p.leaf, p.device] = jnp.zeros(block_shape, self._out_dtype(p.leaf), device=device)
            args = (
                [grad_of(p) for p in subgroup.pieces],
                None if param_of is None else [param_of(p) for p in subgroup.pieces],
                self._starts(subgroup, device),
                state_leaves,
                master_leaves,
                [accumulators.get((p.leaf, p.device)) if p.rows is not None else None for p in subgroup.pieces],
            )
            outputs, new_state, new_master = _EXECUTABLES(_subgroup_update, self._spec(subgroup), *args)
            for p, out in zip(subgroup.pieces, outputs, strict=True):
                (accumulators if p.rows is not None else results)[p.leaf, p.device] = out
            self._counters.event("compute", None, index, started)
            return jax.device_get((new_state, new_master)) if in_callback else (new_state, new_master)

        compiles = compiles_on_this_thread()
        try:
            timings = self._engine.run(order, fetch, compute, lambda k, out: self._store(k, out, step + 1))
        except BaseException:
            self._abort_step(run)
            raise
        run.timings, run.compiles = timings, compiles_on_this_thread() - compiles
        results.update(accumulators)
        return results

    def _end_step(self, run: _Step) -> None:
        self.step = run.step + 1
        self._finish(self.step, run.timings, run.compiles, run.background_wait)
        if jax.process_count() > 1:
            what = f"the end of update step {self.step}"
            peers.barrier(f"{self._run_key}/update/{self.step}", self.config.peer_timeout, what)

    def update(
        self, updates: Any, state: OffloadState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, OffloadState]:
        """Streams every subgroup's state through the device and returns the inner optimizer's updates.

        Called inside ``jax.jit``, it traces the in-jit route instead (see :mod:`jax_mlp.in_jit`).
        """
        del extra_args
        if _is_tracer((updates, state, params)):
            return self._update_traced(updates, state, params)
        self._check_state(state)
        self._check_step(int(state.step))
        grads, param_leaves = self._check_inputs(updates, params)
        placement = _placement(grads, self._shardings)
        grad_blocks = _blocks_by_device(grads, self._shardings)
        param_blocks = None if param_leaves is None else _blocks_by_device(param_leaves, self._shardings)
        run = self._begin_step()
        results = self._stream(
            run,
            self._scheduler.order(run.step),
            lambda p: grad_blocks[p.leaf][p.device],
            None if param_blocks is None else lambda p: param_blocks[p.leaf][p.device],
            lambda subgroup: self._device_of(subgroup, placement),
        )
        self._end_step(run)
        new_updates = jax.tree_util.tree_unflatten(self.plan.treedef, self._leaf_updates(results))
        return new_updates, OffloadState(jnp.asarray(self.step, jnp.int32))

    # ----------------------------------------------------------------------------- in-jit route

    def _owners_by_device(self, mesh: jax.sharding.Mesh) -> dict[int, list[tuple[int, int | None]]]:
        """Per device of ``mesh`` in this process: for each leaf, the key of the update block that device receives.

        A key is (leaf, owner device id), as :meth:`_stream` returns them; the owner is ``None`` for
        leaves on one device, and for a replica it is the device that stores and updates the block.
        """
        owners = [
            None if sharding is None else partition.block_owners(spec.shape, sharding, shards)
            for spec, sharding, shards in zip(self.plan.leaves, self._shardings, self._shards, strict=True)
        ]
        return {
            device.id: [(index, None if of is None else of[device]) for index, of in enumerate(owners)]
            for device in mesh.local_devices
        }

    def _update_traced(self, updates: Any, state: Any, params: Any) -> tuple[Any, OffloadState]:
        """Traces ``update`` as one host callback per device (see :mod:`jax_mlp.in_jit`)."""
        self._check_state(state)
        grads, param_leaves = self._check_inputs(updates, params)
        if isinstance(self._jit_layout, Exception):
            raise self._jit_layout
        layout = self._jit_layout
        shapes = layout.block_shapes([spec.shape for spec in self.plan.leaves])
        out_blocks = [jax.ShapeDtypeStruct(shape, self._out_dtype(i)) for i, shape in enumerate(shapes)]
        leaves = in_jit.host_update(layout, self._update_on_device, grads, param_leaves, state.step, out_blocks)
        return jax.tree_util.tree_unflatten(self.plan.treedef, leaves), OffloadState(state.step + 1)

    def _update_on_device(self, step: np.ndarray, device_index: np.ndarray, *blocks: np.ndarray) -> list[np.ndarray]:
        """One device's host callback: meets the others, then returns its blocks of the updates."""
        device = self._jit_layout.mesh.devices.flat[int(device_index)]
        results = self._rendezvous.meet(
            int(step), device.id, blocks, functools.partial(self._update_on_host, int(step))
        )
        return [results[key] for key in self._jit_owners[device.id]]

    def _update_on_host(self, step: int, blocks_by_device: dict[int, Sequence[np.ndarray]]) -> dict:
        """The whole update on the host CPU backend, with every device's grad (and param) blocks.

        Runs in the callback of the last device to arrive. An error leaves step ``step`` intact and
        this offloader refusing further in-jit updates (the jitted caller cannot roll back with it):
        close it and reopen with ``resume=True``.

        Returns:
          Each owned block's update as a numpy array, by (leaf, owner device id).
        """
        if self._jit_failure is not None:
            raise OffloadError(
                f"an earlier in-jit update of this mlp_offload failed ({self._jit_failure}); its step is intact "
                "on storage: close this mlp_offload and create it again with resume=True"
            )
        n, host = len(self.plan.leaves), self._jit_layout.host
        whole = next(iter(blocks_by_device))  # the device of leaves on one device (a one-device mesh)

        @functools.cache
        def on_host(device: int, index: int) -> jax.Array:  # only owners' blocks are used
            return jax.device_put(blocks_by_device[device][index], host)

        def block_of(offset: int) -> Callable[[partition.Piece], jax.Array]:
            return lambda p: on_host(whole if p.device is None else p.device, offset + p.leaf)

        try:
            self._check_step(step)
            with jax.default_device(host):
                run = self._begin_step()
                results = self._stream(
                    run,
                    self._scheduler.order(run.step),
                    block_of(0),
                    block_of(n) if len(blocks_by_device[whole]) > n else None,
                    lambda _: host,
                    in_callback=True,
                )
                self._end_step(run)
        except BaseException as error:
            self._jit_failure = f"{type(error).__name__}: {error}"
            raise
        return {key: np.asarray(value) for key, value in results.items()}  # this thread waits: see _stream


class OffloadTransformation(optax.GradientTransformationExtraArgs):
    """What :func:`mlp_offload` returns: an optax transformation with a handle on its offloader."""

    __slots__ = ()

    @property
    def offloader(self) -> Offloader:
        """The live :class:`Offloader`: its ``last_stats``, ``flush()`` and ``close()``."""
        return self.init.__self__

    @property
    def stats(self) -> UpdateStats | None:
        """Statistics of the last ``init`` or ``update``."""
        return self.offloader.last_stats

    def flush(self) -> None:
        """See :meth:`Offloader.flush`."""
        self.offloader.flush()

    def close(self, *, delete: bool = False) -> None:
        """See :meth:`Offloader.close`."""
        self.offloader.close(delete=delete)

    def __enter__(self) -> OffloadTransformation:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def mlp_offload(
    inner: optax.GradientTransformation,
    *,
    paths: Sequence[str | os.PathLike | dict | Path] | str | os.PathLike | Path,
    host_cache: int | str = 0,
    subgroup_size: int | str = "64MiB",
    prefetch_depth: int = 2,
    write_depth: int = 2,
    master_dtype: Any = None,
    resume: bool = False,
    io_timeout: float = 600.0,
    peer_timeout: float = 600.0,
    order: str = "alternate",
    flush: str = "idle",
    placement: str = "bandwidth",
    rebalance: bool = True,
    idle_prefetch: bool = True,
    probe: bool = False,
    max_inflight: int = 4,
    node_lock: bool | str | os.PathLike = False,
    on_stats: Callable[[UpdateStats], None] | None = None,
    log_to: str | os.PathLike | None = None,
) -> OffloadTransformation:
    """Wraps an element-wise optax optimizer so its state lives in host RAM and on disk, not on device.

    Put global transformations such as ``optax.clip_by_global_norm`` before it in an ``optax.chain``:
    ``mlp_offload`` sees one subgroup of leaves at a time.

    Args:
      inner: the optimizer whose state is offloaded, e.g. ``optax.adamw(1e-3)``. It must act leaf by
        leaf (adam, adamw, lion, sgd, rmsprop, ...); adafactor is exact on leaves that are not split.
      paths: one or more directories (node-local NVMe, a parallel file system) for the state records;
        a path may also be a tensorstore kvstore spec dict, e.g. ``{"driver": "gcs", "bucket": ..., "path": ...}``,
        or a :class:`Path` with bandwidth caps or declared bandwidths.
      host_cache: host RAM for records kept between updates, e.g. ``"8GiB"``; 0 disables the cache.
      subgroup_size: bytes of state (plus master params) streamed at once, e.g. ``"256MiB"``.
      prefetch_depth: subgroups read ahead of the one being updated.
      write_depth: subgroups whose writes may trail behind the update.
      master_dtype: if set (e.g. ``jnp.float32``), an fp32 master copy of low-precision params is kept
        in the tiers, and ``optax.apply_updates(params, updates)`` gives exactly ``master.astype(params.dtype)``.
      resume: reopen the tiers at their last complete step instead of writing a fresh initial state.
      io_timeout: seconds a single record read or write may take before the update fails.
      peer_timeout: with several ``jax.distributed`` processes, seconds an update (or ``init``)
        waits for every peer to finish the same step; past it, the update raises: a peer died or hangs.
      order: ``"alternate"`` (cache-friendly: ascending, then descending) or ``"ascending"``.
      flush: ``"idle"`` writes dirty cached records back between updates, so the paths always hold a
        complete step; ``"lazy"`` writes them only at eviction, ``flush()``, checkpoint or close.
      placement: ``"bandwidth"`` splits subgroups over paths by bandwidth; ``"round_robin"`` equally.
      rebalance: move subgroups to faster paths when measured throughputs drift apart.
      idle_prefetch: read the next update's first uncached records between updates.
      probe: measure each path's bandwidth at ``init`` (64 MiB each); declared bandwidths win.
      max_inflight: record transfers in flight at once per path, in this process.
      node_lock: ``True`` (or a node-local directory) to let only one process of a node use a given
        path at a time.
      on_stats: called with the :class:`UpdateStats` of each update and of a fresh (not resumed) init,
        e.g. to log them; an exception it raises is logged, never raised.
      log_to: a file to which one JSON line is written per ``init`` and ``update`` (timings, bytes
        and busy time per path, cache hits, placement, and the timed reads, computes and writes);
        emptied first unless ``resume``. ``jax-mlp report`` plots it.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``init`` returns an :class:`OffloadState` and
      which also exposes ``stats``, ``flush()`` and ``close()``.
    """
    config = OffloadConfig.create(
        paths,
        host_cache=host_cache,
        subgroup_size=subgroup_size,
        prefetch_depth=prefetch_depth,
        write_depth=write_depth,
        master_dtype=master_dtype,
        io_timeout=io_timeout,
        peer_timeout=peer_timeout,
        order=order,
        flush=flush,
        placement=placement,
        rebalance=rebalance,
        idle_prefetch=idle_prefetch,
        probe=probe,
        max_inflight=max_inflight,
        node_lock=node_lock,
    )
    if log_to is not None:
        on_stats = fan_out(StatsLog(log_to, append=resume), on_stats)
    offloader = Offloader(inner, config, resume=resume, on_stats=on_stats)
    return OffloadTransformation(offloader.init, offloader.update)
