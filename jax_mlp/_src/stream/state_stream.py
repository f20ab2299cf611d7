"""One update as a transaction, and the state stream that runs them.

:class:`StateStream` is given everything an initialised offloader streams with: the plan's
programs, the scheduler, the tiers and the engine. Each update is a :class:`Transaction`: ``begin``
settles the idle-time I/O and remembers where every record was, ``stream_subgroups`` runs the subgroups
through the engine, and either ``end`` commits the step (stats, scheduler feedback, idle-time
write-back and prefetch) or ``abort`` forgets every trace of it, so the previous step stays intact.
:meth:`StateStream.advance` is that sequence, for every route of ``jax_mlp._src.offload``; they
differ only in their :class:`~jax_mlp._src.stream.blocks.Blocks`, :class:`Moves` and results. An
update that overlaps the backward pass runs the same steps, split over two threads; the fused apply
runs them with the :data:`LATE_PUT` moves and :class:`~jax_mlp._src.stream.blocks.NewParams`
keeping its results. One transaction is open at a time: the stream refuses to begin another, flush
or pin while one is (the offloader settles an overlapped one before any other use).

The engine calls back up through callables: an update hands it this module's ``fetch`` (on reader
threads; idle-time reads ahead call the same one), ``compute`` (on the caller's thread), ``stage``
(on the stager thread: the results to the host and into the tiers, after which their device arrays
are dropped) and ``store`` (on writer threads: the writes of what was staged). Filling the tiers at
init, restore or resume hands it its own fetch (nothing, or a checkpoint's reads) and compute, with
the same stage and store. The tier stack is told each record's path
as data and returns what it moved, which the stream counts.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import jax
import numpy as np

from jax_mlp._src import peers
from jax_mlp._src.config import OffloadConfig
from jax_mlp._src.errors import OffloadError
from jax_mlp._src.plan.partition import Plan
from jax_mlp._src.plan.programs import Programs
from jax_mlp._src.plan.sharding import BlockKey
from jax_mlp._src.schedule.scheduler import Measured, Scheduler
from jax_mlp._src.stats import IOCounters, UpdateStats, compiles_on_this_thread, update_stats
from jax_mlp._src.storage.capacity import check_capacity
from jax_mlp._src.storage.paths import release_paths
from jax_mlp._src.storage.record import HEADER_SIZE, RecordLayout
from jax_mlp._src.storage.tier_stack import Locations, Pin, RecordIO, TierStack, Unwritten
from jax_mlp._src.stream.blocks import Blocks, NewParams, Staging, UpdateBlocks
from jax_mlp._src.stream.engine import Engine, ReadAhead, Timings
from jax_mlp._src.stream.idle import IdleIO
from jax_mlp._src.stream.transfer import choose

logger = logging.getLogger(__name__)


class Moves(NamedTuple):
    """On which threads a subgroup's fields move between host and device (by the stream's transfer).

    Attributes:
      put_on_reader: the reader thread puts the fetched fields on the device; else the compute thread
        does, just before their program runs.
      get_on_compute: the compute thread brings the new fields back to the host; else the writer does.
    """

    put_on_reader: bool
    get_on_compute: bool


EAGER = Moves(put_on_reader=True, get_on_compute=False)
"""An eager update: readers put the fields on the device, writers bring the results back."""

LATE_PUT = Moves(put_on_reader=False, get_on_compute=False)
"""The fused apply's moves: fetched fields stay on the host until their program is about to run,
so the device holds one subgroup's fields besides the writes in flight, never the reads ahead."""

IN_CALLBACK = Moves(put_on_reader=False, get_on_compute=True)
"""Streaming inside a device's host callback: a CPU device then runs only work that the callback's
own thread puts on it and waits for, so transfers and results stay on that thread."""


class Transaction(NamedTuple):
    """One update in progress: the step it starts from, its placement, and what to restore if it fails.

    Attributes:
      step: the step the tiers hold, which the update starts from.
      placement: the path index each subgroup's new record goes to.
      ahead: the records read ahead in idle time, for this update's fetches to take.
      locations: where every stored record was before the update.
      background_wait: seconds waited for the previous update's idle-time writes.
      cached: the subgroups whose new records the host cache keeps (None: its LRU decides).
      idle: seconds since the last update ended (infinite: none has), the time its idle-time writes had.
    """

    step: int
    placement: tuple[int, ...]
    ahead: ReadAhead
    locations: Locations
    background_wait: float
    cached: frozenset[int] | None
    idle: float

    def describer(self, roots: Sequence[str]) -> Callable[[int], str]:
        """Names a subgroup and the paths (``roots``) it is read from and written to, for a hung transfer's message."""

        def describe(index: int) -> str:
            source = self.locations.paths.get(index)
            target = roots[self.placement[index]]
            read = "" if source is None or roots[source] == target else f"read from {roots[source]}, "
            return f"subgroup {index} ({read}on {target})"

        return describe


Results = UpdateBlocks | NewParams


class RunOn(NamedTuple):
    """The writes of an update's last records, which run on past its return into the next forward pass.

    Attributes:
      in_memory: the fields of the records they write, by subgroup, for the idle-time reads ahead to take.
      landed: the writes done, counted (towards the next update) once the next one begins.
    """

    in_memory: dict[int, Any]
    landed: list[RecordIO]


class StateStream:
    """The offloaded state of one plan, streamed through the devices one transaction at a time.

    Args:
      config: the offload's options.
      plan: the subgroups.
      programs: the plan's subgroup programs.
      scheduler: the order and placement policy.
      tiers: the host cache in front of the opened paths.
      engine: the reader and writer threads.
      peer_key: names this offloader alike in every process, for barriers.
      on_stats: called with each update's stats; its errors are logged, never raised.
      init_notes: fields added to the stats of the init or restore (the optimizer check's).
      param_layouts: the params records of a layer-streamed plan, one per subgroup (record ``S + k`` holds
        subgroup ``k``'s params), then, where its updates are deferred, its grads records (``2S + k``); none
        for a plan whose params the user holds.
    """

    def __init__(
        self,
        config: OffloadConfig,
        plan: Plan,
        programs: Programs,
        scheduler: Scheduler,
        tiers: TierStack,
        engine: Engine,
        *,
        peer_key: str,
        on_stats: Callable[[UpdateStats], None] | None,
        init_notes: Mapping[str, Any] = MappingProxyType({}),
        param_layouts: Sequence[RecordLayout] = (),
    ):
        self.config = config
        self.plan = plan
        self.programs = programs
        self.scheduler = scheduler
        self.tiers = tiers
        self.engine = engine
        self.counters = IOCounters([p.root for p in tiers.paths])
        self.step = 0
        self.shared: list[np.ndarray] = []  # the shared state leaves at ``step``, once the tiers hold it
        self.last_stats: UpdateStats | None = None
        layouts = [sg.layout for sg in plan.subgroups] + list(param_layouts)
        self.record_bytes = [
            HEADER_SIZE + layout.nbytes for layout in layouts
        ]  # state, then params (and grads) records
        self._peer_key = peer_key
        self._on_stats = on_stats
        self._init_notes = init_notes
        self.idle = IdleIO(config, scheduler, tiers, engine, self.counters, self._fetch)
        self.transfer = choose(config.transfer, jax.local_devices())
        self._total_compiles = 0
        self._open: Transaction | None = None  # the transaction begun and not yet ended or aborted
        self._run_on: RunOn | None = None  # the last update's writes still running on
        self._finished_at: float | None = None  # when the last update (or the init) was committed

    # ----------------------------------------------------------------------------- filling the tiers

    def write_initial_state(
        self, params: Mapping[BlockKey, jax.Array], devices: Sequence[jax.Device | None], kinds: Sequence[str]
    ) -> None:
        """Streams the initial state (and master params) of the param blocks ``params`` out, at step 0.

        ``devices`` gives each subgroup's device, as in :class:`~jax_mlp._src.stream.blocks.Blocks`, and
        ``kinds`` each leaf's memory kind: blocks in host memory visit the device (:class:`Staging`).
        """
        staging = Staging(self.plan, kinds)

        def compute(index: int, _: None) -> tuple:
            subgroup = self.plan.subgroups[index]
            keys = [(p.leaf, p.device) for p in subgroup.pieces]
            blocks = [staging.on_device("params", key, params[key]) for key in keys]
            computed = self.programs.init(subgroup, blocks, devices[index])
            staging.done(subgroup)
            return computed

        self._populate(0, lambda _: None, compute)

    def write_restored_state(self, step: int, load: Callable[[int], tuple]) -> None:
        """Streams a given state at ``step`` in; ``load(k)`` gives subgroup k's (state, master) leaves."""
        self._populate(step, load, lambda _, loaded: loaded)

    def write_populated(self, step: int, compute: Callable[[int, Any], tuple]) -> None:
        """Streams a state made by ``compute(k, None)`` (subgroup k's state, masters and, for a layer-streamed
        plan, params) into the tiers at ``step``."""
        self._populate(step, lambda _: None, compute)

    def resume_at(self, step: int, locations: dict[int, int]) -> None:
        """Takes up the tiers at ``step``, complete on storage with each subgroup's record where ``locations`` says.

        The shared state is read from the first subgroup's record; that read counts towards no update.
        """
        self.tiers.restore(Locations(locations, ()))
        self.step = step
        first = self.plan.subgroups[0]
        self.shared = [
            np.array(x) for x in self.programs.shared_of(first, self.tiers.fetch(first.index, step).fields[0])
        ]

    def _populate(self, step: int, fetch: Callable[[int], Any], compute: Callable[[int, Any], tuple]) -> None:
        """Streams a whole state at ``step`` into the tiers through the pipeline.

        Records go out in the order of step ``step - 1``, so the cache keeps what step ``step``
        updates first. Before the first one, each path's free space is checked against its share.
        """
        placement = tuple(self.scheduler.placement)
        check_capacity(self.tiers.paths, self.record_bytes, placement)
        compiles = compiles_on_this_thread()
        self.step = step  # the cache and idle-time prefetch started by _finish work at this step
        order = self.scheduler.order(step - 1)

        def compute_noting_shared(index: int, fetched: Any) -> tuple:
            computed = compute(index, fetched)
            if index == order[0]:  # every subgroup holds the shared state alike
                self.shared = [np.array(x) for x in self.programs.shared_of(self.plan.subgroups[index], computed[0])]
            return computed

        stage = self._stager(step, placement)
        store = self._lander(self.counters.count)
        timings = self.engine.pipeline(order, fetch, compute_noting_shared, store, stage=stage)
        self._finish(step, timings, compiles_on_this_thread() - compiles, notes=self._init_notes, whole_state=True)
        self.engine.wait_background()

    # ----------------------------------------------------------------------------- one update

    def advance(
        self,
        step: int,
        blocks: Blocks,
        moves: Moves,
        results: Results | None = None,
        notes: Mapping[str, Any] = MappingProxyType({}),
    ) -> dict[BlockKey, Any]:
        """One update from ``step`` as a transaction: each owned block's result, by (leaf, owner device id).

        ``results`` runs each subgroup's program and keeps what it gives: by default the updates
        (:class:`~jax_mlp._src.stream.blocks.UpdateBlocks`); :class:`~jax_mlp._src.stream.blocks.NewParams` for the fused apply.
        ``notes`` are further fields of its stats.

        Raises:
          OffloadError: ``step`` is not the step the tiers hold.
          Any error of the stream, after the transaction was aborted: step ``step`` is intact.
        """
        self.check_step(step)
        transaction = self.begin()
        try:
            updates, timings, compiles = self.stream_subgroups(
                transaction, blocks, moves, results or UpdateBlocks(self.plan), run_on=True
            )
        except BaseException:
            self.abort(transaction)
            raise
        self.end(transaction, timings, compiles, notes)
        return updates

    def _check_closed_transaction(self, doing: str) -> None:
        """Refuses ``doing`` while a transaction is open: the offloader settles an overlapped one first."""
        if self._open is not None:
            raise OffloadError(
                f"internal error: {doing} while the update from step {self._open.step} is still open; "
                "close this mlp_offload and create it again with resume=True"
            )

    def check_step(self, step: int) -> None:
        """Refuses an ``opt_state`` at another step than the tiers hold."""
        if step != self.step:
            raise OffloadError(
                f"the opt_state passed to update is at step {step}, but the offloaded state is at step {self.step}; "
                "offloaded state cannot go back in time: pass the opt_state returned by the previous update, "
                "or restore a checkpoint"
            )

    def begin(self, *, cache_state: bool = True) -> Transaction:
        """Settles idle-time I/O, drops the records moves left behind, and remembers what to restore.

        With ``cache_state`` false the new state records go straight to their paths, leaving the host
        cache to the params records of a layer-streamed step (whose forward reads them again).
        """
        self._check_closed_transaction("beginning an update")
        idle = math.inf if self._finished_at is None else time.perf_counter() - self._finished_at
        background_wait = self._settle_writes()
        self.tiers.drop_moved()
        placement = tuple(self.scheduler.placement)
        cached = self.scheduler.cached(self.config.host_cache) if cache_state else frozenset()
        ahead = self.idle.take_ahead()
        self._open = Transaction(self.step, placement, ahead, self.tiers.locations, background_wait, cached, idle)
        return self._open

    def stream_subgroups(
        self,
        transaction: Transaction,
        blocks: Blocks,
        moves: Moves,
        results: Results,
        stored: Callable[[int], None] | None = None,
        *,
        run_on: bool = False,
    ) -> tuple[dict[BlockKey, Any], Timings, int]:
        """Streams every subgroup in this step's order through its device, storing step ``transaction.step + 1``.

        A subgroup's program runs once its blocks are in ``blocks`` (an overlapped update's grads come
        in while it streams); the step is neither committed nor aborted here: :meth:`end` or :meth:`abort`.
        ``stored(k)``, if given, is called once subgroup k's records are stored.

        Each subgroup's results are brought to the host and staged (cached, or held in memory until written)
        on the engine's stager thread, in this step's order (so the cache's LRU sees that order), and their
        device arrays dropped before their writes begin. With ``run_on``, the writes of the last
        ``write_depth`` subgroups run on past the return, so that the next forward pass has the disks' write
        bandwidth too: the idle-time reads ahead take their records from memory. The next :meth:`begin`,
        :meth:`flush` or :meth:`abort` waits for them.

        Returns:
          Each block's result by (leaf, owner device id), the stream's timings, and its compile count.
        """
        step = transaction.step
        describe = transaction.describer([path.root for path in self.tiers.paths])

        def fetch(index: int) -> Any:
            early = transaction.ahead.take(index)
            if early is not None:
                fields = self.engine.result(early, f"reading {describe(index)} ahead")
            else:
                fields = self._fetch(index, step)
            return self.transfer.to_device(fields, blocks.devices[index]) if moves.put_on_reader else fields

        def compute(index: int, fetched: Any) -> tuple:
            started = time.perf_counter()
            subgroup = self.plan.subgroups[index]
            on_device = fetched if moves.put_on_reader else self.transfer.to_device(fetched, blocks.devices[index])
            out = results.compute(self.programs, subgroup, blocks, on_device)
            self.counters.computed(index, started)
            new = (out.state_leaves, out.master_leaves)
            if out.param_pieces is not None:
                new = (*new, out.param_pieces)
            return tuple(self.transfer.to_host(leaves) for leaves in new) if moves.get_on_compute else new

        compiles = compiles_on_this_thread()
        order = self.scheduler.order(step)
        stage = self._stager(step + 1, transaction.placement, transaction.cached)
        behind = frozenset(order[max(0, len(order) - self.engine.write_depth) :] if run_on else ())
        self._run_on = running = RunOn({}, [])
        land_behind, land = self._lander(running.landed.append), self._lander(self.counters.count)

        def stage_noting_behind(index: int, computed: tuple) -> list[Unwritten]:
            staged = stage(index, computed)
            if index in behind:
                running.in_memory.update((u.subgroup, u.entry.fields) for u in staged if u.entry.step == step + 1)
            return staged

        def store(index: int, staged: list[Unwritten]) -> None:
            (land_behind if index in behind else land)(index, staged)
            if stored is not None:
                stored(index)

        timings = self.engine.pipeline(order, fetch, compute, store, describe, len(behind), stage_noting_behind)
        return results.result(), timings, compiles_on_this_thread() - compiles

    def _fetch(self, index: int, step: int, *, keep: bool = False) -> Any:
        """Record ``index``'s fields at ``step`` from the tiers, counted as a cache hit or a read; with ``keep``,
        one read from a path stays in the cache (see :meth:`TierStack.fetch`)."""
        fetched = self.tiers.fetch(index, step, keep=keep)
        if fetched.read is None:
            self.counters.hit()
        else:
            self.counters.count(fetched.read)
        return fetched.fields

    def fetch_params(self, subgroup: int, step: int) -> list[Any]:
        """Subgroup ``subgroup``'s params at ``step``, from its params record (a layer-streamed plan), kept in the
        cache: the params a forward reads last are those its backward reads first."""
        return self._fetch(len(self.plan.subgroups) + subgroup, step, keep=True)[0]

    def fetch_grads(self, subgroup: int, step: int) -> list[Any]:
        """Subgroup ``subgroup``'s grads stored by :meth:`store_grads` for the update to ``step``, from its grads record."""
        return self._fetch(2 * len(self.plan.subgroups) + subgroup, step)[0]

    def store_grads(self, subgroup: int, pieces: Sequence[np.ndarray], step: int) -> None:
        """Writes subgroup ``subgroup``'s grads for the update to ``step`` (a deferred update, see
        :mod:`jax_mlp._src.offload.layers`) to its grads record (``2S + subgroup``), on the path the placement
        gives it. Never cached and never committed: a crash loses them, and the step that made them is run again."""
        record = 2 * len(self.plan.subgroups) + subgroup
        self.counters.count(self.tiers.write(record, (list(pieces), []), step, self.scheduler.placement[record]))

    def abort(self, transaction: Transaction) -> None:
        """Step ``transaction.step`` is intact in the other slot: forgets every trace of the unfinished one."""
        self._open = None
        self.engine.settle_background()  # its writes running on, which a step run again would write beside
        self._run_on = None
        self.tiers.discard_unwritten(transaction.step + 1)
        self.tiers.cache.discard_unless_step(transaction.step)
        self.tiers.restore(transaction.locations)
        self.engine.settle(transaction.ahead.take_all())

    def end(
        self, transaction: Transaction, timings: Timings, compiles: int, notes: Mapping[str, Any] = MappingProxyType({})
    ) -> None:
        """Commits the step: stats (with ``notes`` among them), idle-time I/O, and with several processes a barrier."""
        self._open = None
        self.step = transaction.step + 1
        in_memory = {} if self._run_on is None else self._run_on.in_memory
        self._finish(self.step, timings, compiles, transaction.background_wait, notes, in_memory, transaction.idle)
        what = f"the end of update step {self.step}"
        peers.barrier(f"{self._peer_key}/update/{self.step}", self.config.peer_timeout, what)

    def _stager(
        self, step: int, placement: tuple[int, ...], cached: frozenset[int] | None = None
    ) -> Callable[[int, tuple], list[Unwritten]]:
        """Stages records of ``step`` in the tiers (:meth:`TierStack.stage`), each for the path ``placement`` gives
        it; the host cache keeps the state records of ``cached`` (None: any). Returns what must be written.

        A subgroup's computed ``(state leaves, master leaves)`` go to its state record; a third part, its
        new params (a layer-streamed step), to its params record, which the cache's LRU may keep.
        """

        def stage(index: int, computed: tuple) -> list[Unwritten]:
            fields = tuple(self.transfer.to_host(leaves) for leaves in computed)
            records = [(index, fields[:2], cached)]
            if len(fields) == 3:
                records.append((len(self.plan.subgroups) + index, (fields[2], []), None))
            return [
                unwritten
                for record, held, keep in records
                for unwritten in self.tiers.stage(record, held, self.record_bytes[record], step, placement, keep)
            ]

        return stage

    def _lander(self, count: Callable[[RecordIO], None]) -> Callable[[int, list[Unwritten]], None]:
        """The writer threads' store: writes what :meth:`_stager` staged for a subgroup, handing each write to
        ``count``. It holds host fields only: the results' device arrays went with the staging."""

        def land(_: int, staged: list[Unwritten]) -> None:
            for unwritten in staged:
                count(self.tiers.land(unwritten))

        return land

    def _settle_writes(self) -> float:
        """Waits for the last update's writes that ran on and the idle-time write-back, counts the first, then
        writes again what a failed write left in memory. Returns the seconds waited."""
        waited = self.engine.wait_background()
        run_on, self._run_on = self._run_on, None
        for written in () if run_on is None else run_on.landed:
            self.counters.count(written)
        for written in self.tiers.land_left(self.scheduler.placement):
            self.counters.count(written)
        return waited

    # ----------------------------------------------------------------------------- between updates

    def _finish(
        self,
        step: int,
        timings: Timings,
        compiles: int,
        extra_wait: float = 0.0,
        notes: Mapping[str, Any] = MappingProxyType({}),
        in_memory: Mapping[int, Any] = MappingProxyType({}),
        idle: float = math.inf,
        whole_state: bool = False,
    ) -> None:
        """Closes a step's accounting, then starts the idle-time I/O that overlaps the user's next forward pass.

        ``notes`` are further fields of its stats (those of the optimizer check, for an init); ``in_memory``
        the records of ``step`` whose writes run on, by subgroup (their fields), which the reads ahead take;
        ``idle`` the seconds between the last update and this one. ``whole_state``: the step wrote the whole
        state (an init or a restore), whose writes give the scheduler its first split.
        """
        ended = time.perf_counter()
        self._total_compiles += compiles
        usages = [path.traffic.take_usage() for path in self.tiers.paths]
        waited = timings.read_wait + timings.write_wait + extra_wait
        if whole_state:
            self.scheduler.start(usages)
        else:
            self.scheduler.observe(usages, self.config.host_cache, Measured(timings.total + extra_wait, waited, idle))
        stats = update_stats(
            step,
            timings,
            extra_wait,
            self.counters,
            compiles,
            self._total_compiles,
            self.tiers.locations.paths,
            [path.root for path in self.tiers.paths],
            self.scheduler.speeds,
            self.scheduler.last_moves,
            self.scheduler.fallback,
            ended,
        )
        self.last_stats = stats._replace(transfer=self.transfer.name, **notes)
        self.counters.reset()  # idle-time I/O started below counts towards the next update
        self.idle.after_update(step, in_memory)
        _report(self._on_stats, self.last_stats)
        self._finished_at = time.perf_counter()

    @property
    def prefetched(self) -> tuple[int, ...]:
        """The subgroups read ahead in idle time for the next update, in the order they were started."""
        return self.idle.prefetched

    @property
    def idle_io_done(self) -> bool:
        """Whether the idle-time write-back started by the last update has finished."""
        return self.engine.background_done()

    def use_idle_window(self) -> None:
        """A call that only accumulates gradients: reads further ahead for the next update (see :class:`IdleIO`)."""
        self._check_closed_transaction("accumulating grads")
        self.idle.use_window(self.step)

    def flush(self) -> None:
        """Writes every dirty cached record to storage, so the tiers alone hold the newest step."""
        self._check_closed_transaction("flushing")
        self._settle_writes()
        self.idle.flush()

    def pin(self) -> Pin:
        """Flushes, then pins the current step for a reader beside training (see :meth:`TierStack.pin`)."""
        self.flush()
        return self.tiers.pin(self.step, self.config.io_timeout)

    def close(self, *, delete: bool) -> None:
        """Stops the threads, empties the cache, if ``delete`` removes the files (no flush), and lets go of the paths."""
        try:
            self.idle.settle()
            self.engine.settle_background()
            self.engine.close()
            self.tiers.cache.clear()
            if delete:
                for path in self.tiers.paths:
                    path.remove()
        finally:
            release_paths(self.tiers.paths)


def _report(on_stats: Callable[[UpdateStats], None] | None, stats: UpdateStats) -> None:
    """Hands ``stats`` to the user's callback; what it raises is logged, never raised."""
    if on_stats is None:
        return
    try:
        on_stats(stats)
    except Exception:  # a logging failure must not desynchronise the step from the tiers
        logger.exception("the on_stats callback of mlp_offload raised; training goes on")
