"""One update as a transaction, and the state stream that runs them.

:class:`StateStream` holds everything an initialised offloader streams with: the plan and its
programs, the tiers, the engine, the scheduler and the counters. Each update is a
:class:`Transaction`: ``begin`` settles the idle-time I/O and remembers where every record was,
``stream`` runs the subgroups through the engine, and either ``end`` commits the step (stats,
scheduler feedback, idle-time write-back and prefetch) or ``abort`` forgets every trace of it, so
the previous step stays intact. :meth:`StateStream.run_step` is that sequence, for the eager and the
in-jit route alike; the two differ only in their :class:`Blocks` and :class:`Route`. The fused apply
runs it too, with the :data:`LATE_PUT` route and :class:`NewParams` keeping its results.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from types import MappingProxyType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_mlp import kernels, partition, peers
from jax_mlp.config import OffloadConfig
from jax_mlp.engine import Engine, Timings
from jax_mlp.errors import OffloadError
from jax_mlp.kernels import Programs
from jax_mlp.model import starting_speed
from jax_mlp.partition import Piece, Plan, Subgroup
from jax_mlp.placement import BlockKey, LeafPlacement
from jax_mlp.scheduler import Scheduler
from jax_mlp.stats import IOCounters, UpdateStats, compiles_on_this_thread, update_stats
from jax_mlp.storage.cache import HostCache
from jax_mlp.storage.capacity import check_capacity
from jax_mlp.storage.paths import PathStore, release_paths
from jax_mlp.storage.record import HEADER_SIZE, record_codec
from jax_mlp.storage.tier_stack import Pin, TierStack

logger = logging.getLogger(__name__)


class Blocks(NamedTuple):
    """Where one update's inputs are: a piece's grad block, its param block, a subgroup's device.

    Attributes:
      grad_of: a piece's gradient block (the whole leaf, or its shard).
      param_of: the same for params, or None when the update needs no params.
      device_of: where a subgroup's update runs.
      uniform: what every subgroup is given alike (the shared state and the extra arguments).
    """

    grad_of: Callable[[Piece], jax.Array]
    param_of: Callable[[Piece], jax.Array] | None
    device_of: Callable[[Subgroup], jax.Device | None]
    uniform: kernels.Uniform


def _unchanged(fields: Any, device: jax.Device | None = None) -> Any:
    del device
    return fields


class Route(NamedTuple):
    """How a route moves a subgroup's fields between host and device, and on which thread.

    Attributes:
      load: on the reader thread, the fetched host fields to what compute takes.
      enter: on the compute thread, those to device arrays.
      leave: on the compute thread, the new fields to what the writer thread stores.
    """

    load: Callable[[Any, jax.Device | None], Any]
    enter: Callable[[Any, jax.Device | None], Any]
    leave: Callable[[Any], Any]


EAGER = Route(load=jax.device_put, enter=_unchanged, leave=_unchanged)
"""The eager route: readers put the fields on the device, writers bring the results back."""

LATE_PUT = Route(load=_unchanged, enter=jax.device_put, leave=_unchanged)
"""The fused apply's route: fetched fields stay on the host until their program is about to run,
so the device holds one subgroup's fields besides the writes in flight, never the reads ahead."""

IN_CALLBACK = Route(load=_unchanged, enter=jax.device_put, leave=jax.device_get)
"""Streaming inside a device's host callback: a CPU device then runs only work that the callback's
own thread puts on it and waits for, so transfers and results stay on that thread."""


class Transaction(NamedTuple):
    """One update in progress: the step it starts from, and what to restore if it fails."""

    step: int
    prefetched: dict[int, Future]
    locations: dict[int, int]
    moved: list[tuple[int, int]]
    background_wait: float


class UpdateBlocks:
    """The update blocks of one step, as subgroups produce them: whole pieces' blocks, and one
    accumulator per row-split block that its chunks' programs write into in place."""

    def __init__(self, plan: Plan):
        self._plan = plan
        self._blocks: dict[BlockKey, jax.Array] = {}
        self._accumulators: dict[BlockKey, jax.Array] = {}

    def accumulators_for(self, subgroup: Subgroup, device: jax.Device | None) -> list[jax.Array | None]:
        """Per piece, its block's accumulator if it is a row chunk (made on first use), else None."""
        for p in subgroup.pieces:
            if p.rows is not None and (p.leaf, p.device) not in self._accumulators:
                shape = partition.piece_shape(self._plan.leaves[p.leaf], p._replace(rows=None))
                dtype = kernels.update_dtype(self._plan, p.leaf)
                self._accumulators[p.leaf, p.device] = jnp.zeros(shape, dtype, device=device)
        return [self._accumulators[p.leaf, p.device] if p.rows is not None else None for p in subgroup.pieces]

    def take(self, subgroup: Subgroup, outputs: Sequence[jax.Array]) -> None:
        """Keeps a subgroup's outputs: its whole blocks, and the new accumulators of its chunks."""
        for p, out in zip(subgroup.pieces, outputs, strict=True):
            (self._accumulators if p.rows is not None else self._blocks)[p.leaf, p.device] = out

    def run(
        self, programs: Programs, subgroup: Subgroup, device: jax.Device | None, blocks: Blocks, fields: tuple
    ) -> kernels.SubgroupUpdate:
        """Runs a subgroup's update program and keeps its update blocks."""
        grads = [blocks.grad_of(p) for p in subgroup.pieces]
        params = None if blocks.param_of is None else [blocks.param_of(p) for p in subgroup.pieces]
        accumulators = self.accumulators_for(subgroup, device)
        out = programs.update(subgroup, device, grads, params, fields, accumulators, blocks.uniform.to(device))
        self.take(subgroup, out.outputs)
        return out

    def result(self) -> dict[BlockKey, jax.Array]:
        """Every block's update, by (leaf, owner device id)."""
        return {**self._blocks, **self._accumulators}


class NewParams:
    """The param blocks of one fused apply, each replaced by its new value as subgroups produce it.

    Each program is given its pieces' current blocks (a row chunk: its leaf's whole block) and
    donates them, so a new block takes the old one's buffer and no block is ever held twice. Once a
    leaf's last piece has run, ``release(leaf)`` lets its gradient go.

    Args:
      plan: the subgroups.
      blocks: each param block, by (leaf, owner device id); taken over (emptied as blocks are donated).
      release: called with a leaf's index once no subgroup of this step needs its gradient any more.
    """

    def __init__(self, plan: Plan, blocks: dict[BlockKey, jax.Array], release: Callable[[int], None]):
        self._blocks = blocks
        self._uses = collections.Counter(p.leaf for subgroup in plan.subgroups for p in subgroup.pieces)
        self._release = release

    def run(
        self, programs: Programs, subgroup: Subgroup, device: jax.Device | None, blocks: Blocks, fields: tuple
    ) -> kernels.SubgroupUpdate:
        """Runs a subgroup's apply program on its donated param blocks and keeps the new ones."""
        keys = [(p.leaf, p.device) for p in subgroup.pieces]
        grads = [blocks.grad_of(p) for p in subgroup.pieces]
        params = [self._blocks.pop(k) for k in keys]
        out = programs.apply(subgroup, device, grads, params, fields, blocks.uniform.to(device))
        self._blocks.update(zip(keys, out.outputs, strict=True))
        for p in subgroup.pieces:
            self._uses[p.leaf] -= 1
            if not self._uses[p.leaf]:
                self._release(p.leaf)
        return out

    def result(self) -> dict[BlockKey, jax.Array]:
        """Every block's new params, by (leaf, owner device id)."""
        return self._blocks


class StateStream:
    """The offloaded state of one plan, streamed through the devices one transaction at a time.

    Args:
      inner: the optimizer whose state is streamed.
      config: the offload's options.
      plan: the subgroups.
      paths: the opened storage paths.
      run_key: names this offloader alike in every process, for barriers.
      on_stats: called with each update's stats; its errors are logged, never raised.
      init_notes: fields added to the stats of the init or restore (the optimizer check's).
    """

    def __init__(
        self,
        inner: optax.GradientTransformation,
        config: OffloadConfig,
        plan: Plan,
        paths: list[PathStore],
        *,
        run_key: str,
        on_stats: Callable[[UpdateStats], None] | None,
        init_notes: Mapping[str, Any] = MappingProxyType({}),
    ):
        self.config = config
        self.plan = plan
        self.programs = Programs(inner, plan)
        self.scheduler = Scheduler(
            [HEADER_SIZE + sg.layout.nbytes for sg in plan.subgroups],
            [starting_speed(p, config.probe) for p in config.paths],
            order=config.order,
            placement=config.placement,
            rebalance=config.rebalance,
        )
        self.counters = IOCounters([p.root for p in paths])
        codec = record_codec([sg.layout for sg in plan.subgroups], plan.layout_hash)
        self.tiers = TierStack(
            HostCache(config.host_cache), paths, plan.layout_hash, self.scheduler.path_of, self.counters, codec
        )
        self.engine = Engine(config.prefetch_depth, config.write_depth, config.io_timeout)
        self.step = 0
        self.shared: list[np.ndarray] = []  # the shared state leaves at ``step``, once the tiers hold it
        self.last_stats: UpdateStats | None = None
        self._run_key = run_key
        self._on_stats = on_stats
        self._init_notes = init_notes
        self._prefetched: dict[int, Future] = {}
        self._total_compiles = 0

    # ----------------------------------------------------------------------------- filling the tiers

    def write_initial_state(self, params: Sequence[jax.Array], placement: LeafPlacement) -> None:
        """Streams the inner optimizer's initial state (and master params) of ``params`` out, at step 0."""
        home = placement.home(params)
        blocks = placement.blocks(params)

        def compute(index: int, _: None) -> tuple:
            subgroup = self.plan.subgroups[index]
            leaves = [blocks[p.leaf][p.device] for p in subgroup.pieces]
            return self.programs.init(subgroup, leaves, placement.device_of(subgroup, home))

        self._populate(0, lambda _: None, compute)

    def write_restored_state(self, step: int, load: Callable[[int], tuple]) -> None:
        """Streams a given state at ``step`` in; ``load(k)`` gives subgroup k's (state, master) leaves."""
        self._populate(step, load, lambda _, loaded: loaded)

    def resume_at(self, step: int, locations: dict[int, int]) -> None:
        """Takes up the tiers at ``step``, complete on storage with each subgroup's record where ``locations`` says.

        The shared state is read from the first subgroup's record; that read counts towards no update.
        """
        self.tiers.locations.update(locations)
        self.step = step
        first = self.plan.subgroups[0]
        self.shared = [np.array(x) for x in self.programs.shared_of(first, self.tiers.fetch(first.index, step)[0])]
        self.counters.reset()

    def _populate(self, step: int, fetch: Callable[[int], Any], compute: Callable[[int, Any], tuple]) -> None:
        """Streams a whole state at ``step`` into the tiers through the pipeline.

        Records go out in the order of step ``step - 1``, so the cache keeps what step ``step``
        updates first. Before the first one, each path's free space is checked against its share.
        """
        check_capacity(self.tiers.paths, self.scheduler.record_bytes, self.scheduler.placement)
        compiles = compiles_on_this_thread()
        self.step = step  # the cache and idle-time prefetch started by _finish work at this step
        order = self.scheduler.order(step - 1)

        def compute_noting_shared(index: int, fetched: Any) -> tuple:
            computed = compute(index, fetched)
            if index == order[0]:  # every subgroup holds the shared state alike
                self.shared = [np.array(x) for x in self.programs.shared_of(self.plan.subgroups[index], computed[0])]
            return computed

        timings = self.engine.run(order, fetch, compute_noting_shared, lambda k, out: self._store(k, out, step))
        self._finish(step, timings, compiles_on_this_thread() - compiles, notes=self._init_notes)
        self.engine.wait_background()

    # ----------------------------------------------------------------------------- one update

    def run_step(
        self, step: int, blocks: Blocks, route: Route, results: UpdateBlocks | NewParams | None = None
    ) -> dict[BlockKey, jax.Array]:
        """One update from ``step`` as a transaction: each owned block's result, by (leaf, owner device id).

        ``results`` runs each subgroup's program and keeps what it gives: by default the updates
        (:class:`UpdateBlocks`); :class:`NewParams` for the fused apply.

        Raises:
          OffloadError: ``step`` is not the step the tiers hold.
          Any error of the stream, after the transaction was aborted: step ``step`` is intact.
        """
        self.check_step(step)
        transaction = self.begin()
        try:
            updates, timings, compiles = self.stream(transaction, blocks, route, results or UpdateBlocks(self.plan))
        except BaseException:
            self.abort(transaction)
            raise
        self.end(transaction, timings, compiles)
        return updates

    def check_step(self, step: int) -> None:
        """Refuses an ``opt_state`` at another step than the tiers hold."""
        if step != self.step:
            raise OffloadError(
                f"the opt_state passed to update is at step {step}, but the offloaded state is at step {self.step}; "
                "offloaded state cannot go back in time: pass the opt_state returned by the previous update, "
                "or restore a checkpoint"
            )

    def begin(self) -> Transaction:
        """Settles idle-time I/O and remembers what to restore if the update fails."""
        background_wait = self.engine.wait_background()
        if self.config.flush == "idle":
            self.tiers.drop_moved()
        prefetched, self._prefetched = self._prefetched, {}
        tiers = self.tiers
        return Transaction(self.step, prefetched, dict(tiers.locations), list(tiers.moved), background_wait)

    def stream(
        self, transaction: Transaction, blocks: Blocks, route: Route, results: UpdateBlocks | NewParams
    ) -> tuple[dict[BlockKey, jax.Array], Timings, int]:
        """Streams every subgroup in this step's order through its device, storing step ``transaction.step + 1``.

        Returns:
          Each block's result by (leaf, owner device id), the stream's timings, and its compile count.
        """
        plan, step = self.plan, transaction.step

        def fetch(index: int) -> Any:
            early = transaction.prefetched.pop(index, None)
            if early is not None:
                fields = self.engine.result(early, f"reading subgroup {index} ahead")
            else:
                fields = self.tiers.fetch(index, step)
            return route.load(fields, blocks.device_of(plan.subgroups[index]))

        def compute(index: int, fetched: Any) -> tuple:
            started = time.perf_counter()
            subgroup = plan.subgroups[index]
            device = blocks.device_of(subgroup)
            out = results.run(self.programs, subgroup, device, blocks, route.enter(fetched, device))
            self.counters.event("compute", None, index, started)
            return route.leave((out.state_leaves, out.master_leaves))

        compiles = compiles_on_this_thread()
        order = self.scheduler.order(step)
        timings = self.engine.run(order, fetch, compute, lambda k, out: self._store(k, out, step + 1))
        return results.result(), timings, compiles_on_this_thread() - compiles

    def abort(self, transaction: Transaction) -> None:
        """Step ``transaction.step`` is intact in the other slot: forgets every trace of the unfinished one."""
        self.tiers.cache.discard_unless_step(transaction.step)
        self.tiers.locations, self.tiers.moved = transaction.locations, transaction.moved
        self.engine.settle(transaction.prefetched.values())

    def end(self, transaction: Transaction, timings: Timings, compiles: int) -> None:
        """Commits the step: stats, idle-time I/O, and with several processes a barrier."""
        self.step = transaction.step + 1
        self._finish(self.step, timings, compiles, transaction.background_wait)
        if jax.process_count() > 1:
            what = f"the end of update step {self.step}"
            peers.barrier(f"{self._run_key}/update/{self.step}", self.config.peer_timeout, what)

    def _store(self, index: int, computed: tuple, step: int) -> None:
        """Writer thread: the (state, master) leaves to host arrays (no copy on CPU), then into the tiers."""
        fields = tuple([np.asarray(x) for x in leaves] for leaves in computed)
        self.tiers.store(index, fields, HEADER_SIZE + self.plan.subgroups[index].layout.nbytes, step)

    # ----------------------------------------------------------------------------- between updates

    def _finish(
        self,
        step: int,
        timings: Timings,
        compiles: int,
        extra_wait: float = 0.0,
        notes: Mapping[str, Any] = MappingProxyType({}),
    ) -> None:
        """Closes a step's accounting, then starts the idle-time I/O that overlaps the user's next forward pass.

        ``notes`` are further fields of its stats (those of the optimizer check, for an init).
        """
        self._total_compiles += compiles
        self.scheduler.observe([path.traffic.take_usage() for path in self.tiers.paths])
        stats = update_stats(
            step,
            timings,
            extra_wait,
            self.counters,
            compiles,
            self._total_compiles,
            self.tiers.locations,
            [path.root for path in self.tiers.paths],
            self.scheduler.speeds,
        )
        self.last_stats = stats._replace(**notes)
        self.counters.reset()  # idle-time I/O started below counts towards the next update
        if self.config.flush == "idle":
            self._write_back_dirty()
        if self.config.idle_prefetch:
            self._prefetch_next(self.config.prefetch_depth)
        self._report(self.last_stats)

    def _report(self, stats: UpdateStats) -> None:
        if self._on_stats is None:
            return
        try:
            self._on_stats(stats)
        except Exception:  # a logging failure must not desynchronise the step from the tiers
            logger.exception("the on_stats callback of mlp_offload raised; training goes on")

    def _prefetch_next(self, depth: int) -> None:
        """Starts reading the next update's first ``depth`` uncached records while forward and backward run."""
        for index in self.scheduler.order(self.step):
            if len(self._prefetched) >= depth:
                return
            if index not in self._prefetched and not self.tiers.cache.holds(index, self.step):
                self._prefetched[index] = self.engine.read_ahead(self.tiers.fetch, index, self.step)

    def use_idle_window(self) -> None:
        """A call that only accumulates gradients: the disks stay idle for the next update, so read further ahead.

        The idle-time write-back and prefetch started by the last update run on through the whole
        window. Once the write-back has drained, the writers' share of host memory is free until the
        next update, so the read-ahead grows to ``prefetch_depth + write_depth`` records: the update
        consumes them first, before its own stores fill that share again.
        """
        if not self.config.idle_prefetch:
            return
        depth = self.config.prefetch_depth
        if self.engine.background_done():
            depth += self.config.write_depth
        self._prefetch_next(depth)

    @property
    def prefetched(self) -> tuple[int, ...]:
        """The subgroups read ahead for the next update, in the order they were started."""
        return tuple(self._prefetched)

    def _write_back_dirty(self) -> None:
        """Queues every dirty cached record for writing on the writer threads (idle-time I/O)."""
        for subgroup, entry in self.tiers.cache.dirty():
            self.engine.submit_background(self.tiers.write_back, subgroup, entry)

    def flush(self) -> None:
        """Writes every dirty cached record to storage, so the tiers alone hold the newest step."""
        self._write_back_dirty()
        self.engine.wait_background()
        self.tiers.drop_moved()

    def pin(self) -> Pin:
        """Flushes, then pins the current step for a reader beside training (see :meth:`TierStack.pin`)."""
        self.flush()
        return self.tiers.pin(self.step, self.config.io_timeout)

    def close(self, *, delete: bool) -> None:
        """Stops the threads, empties the cache, if ``delete`` removes the files (no flush), and lets go of the paths."""
        try:
            self.engine.settle(self._prefetched.values())
            self.engine.close()
            self.tiers.cache.clear()
            if delete:
                for path in self.tiers.paths:
                    path.remove()
        finally:
            release_paths(self.tiers.paths)
