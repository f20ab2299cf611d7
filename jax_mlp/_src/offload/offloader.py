"""The offloader: the lifecycle of one ``mlp_offload`` (init, resume, restore, update, flush, close).

It plans the subgroups, opens the paths, builds the state stream's parts, fills the tiers (or finds
the step to resume at) and hands each ``update`` and ``apply`` to its
:class:`~jax_mlp._src.offload.calls.Calls`, which checks the call and routes it to the stream. A
failed ``init`` leaves nothing behind but what it wrote, so it can be retried.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_mlp._src import peers
from jax_mlp._src.config import OffloadConfig
from jax_mlp._src.errors import OffloadError
from jax_mlp._src.offload import accumulation, inputs, planning, resume
from jax_mlp._src.offload.calls import Calls
from jax_mlp._src.offload.in_jit import JitLayout, JitRoute
from jax_mlp._src.offload.overlap import Overlap
from jax_mlp._src.parsing import parse_rate
from jax_mlp._src.plan.partition import Plan
from jax_mlp._src.plan.sharding import LeafSharding
from jax_mlp._src.schedule.scheduler import Scheduler
from jax_mlp._src.state import OffloadState
from jax_mlp._src.stats import UpdateStats
from jax_mlp._src.storage.paths import open_paths, release_paths
from jax_mlp._src.storage.tier_stack import Pin

__all__ = ["OffloadState", "Offloader"]

_INSTANCES = itertools.count()  # names this process's offloaders alike in every process, for barriers


class ClosesOnExit:
    """A context manager that returns itself and calls ``self.close()`` on exit, also on an exception."""

    __slots__ = ()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class Offloader(ClosesOnExit):
    """The live object behind ``mlp_offload``: plan, tiers, engine and compiled functions.

    Use it through the ``optax.GradientTransformationExtraArgs`` that :func:`~jax_mlp.mlp_offload`
    returns; keep a reference to that object to read ``stats`` and to ``close()`` it.

    Args:
      inner: the optimizer whose state is offloaded.
      config: the options.
      resume: ``init`` reopens the tiers at their last complete step.
      on_stats: called with the stats of each update and of a fresh init.
    """

    def __init__(
        self,
        inner: optax.GradientTransformation,
        config: OffloadConfig,
        *,
        resume: bool = False,
        on_stats: Callable[[UpdateStats], None] | None = None,
    ):
        self.inner = optax.with_extra_args_support(inner)
        self.config = config
        self.resume = resume
        self.on_stats = on_stats
        self._peer_key = f"jax_mlp/{next(_INSTANCES)}"
        self._calls: Calls | None = None
        self._closed = False
        self._last_plan: planning.Planned | None = None

    # ----------------------------------------------------------------------------- read-only views

    @property
    def plan(self) -> Plan | None:
        """The subgroups, or None before ``init``."""
        return None if self._calls is None else self._calls.plan

    @property
    def sharding(self) -> LeafSharding:
        """Each leaf's sharding and owned shards, as at ``init``."""
        return self._initialised().sharding

    @property
    def step(self) -> int:
        """The step the tiers hold (0 before ``init``)."""
        return 0 if self._calls is None else self._calls.stream.step

    @property
    def last_stats(self) -> UpdateStats | None:
        """Statistics of the last ``init`` or ``update``."""
        return None if self._calls is None else self._calls.stream.last_stats

    @property
    def scheduler(self) -> Scheduler:
        """The live order and placement policy, for reading (``placement``, ``shares``, ``speeds``, ``moves``)."""
        return self._initialised().stream.scheduler

    @property
    def prefetched(self) -> tuple[int, ...]:
        """The subgroups read ahead in idle time for the next update, in the order they were started."""
        return self._initialised().stream.prefetched

    @property
    def idle_io_done(self) -> bool:
        """Whether the idle-time write-back started by the last update has finished."""
        return self._initialised().stream.idle_io_done

    @property
    def jit_layout(self) -> JitLayout | None:
        """The mesh, specs and host CPU device the in-jit route runs on, or None where it cannot serve."""
        return self._initialised().jit.layout

    # ----------------------------------------------------------------------------- lifecycle

    def plan_for(self, params: Any) -> Plan:
        """The subgroups ``init`` gives these params (their shapes and dtypes), after the optimizer check.

        ``init`` and :meth:`init_from` reuse it, so a restore can read its checkpoint by the plan first.

        Raises:
          CoupledOptimizerError: the optimizer couples leaves; ``OffloadError`` for other refusals.
        """
        return self._planned(params).plan

    def _planned(self, params: Any) -> planning.Planned:
        inputs.check_has_leaves(params)
        inputs.check_float_leaves(params)
        leaves = jax.tree_util.tree_leaves(params)
        inputs.check_master_dtype(leaves, self.config.master_dtype)
        inputs.check_param_memory(params, self.config.accumulate_steps)
        key = (jax.tree_util.tree_structure(params), tuple(planning.signature(x) for x in leaves))
        if self._last_plan is None or self._last_plan.key != key:
            self._last_plan = planning.plan_params(self.inner, self.config, params, key)
        return self._last_plan._replace(leaves=leaves)

    def init(self, params: Any) -> OffloadState:
        """Plans the subgroups and streams the inner optimizer's initial state out to the tiers.

        With ``resume=True`` it reopens the tiers at their last complete step instead. The paths are
        marked as holding this run (``run.json``) only once that has succeeded, so a failed ``init``
        can simply be retried.
        """
        if self.resume:
            resume_at = functools.partial(resume.resume_at, peer_key=self._peer_key)
            return self._initialise(params, lambda live, _: resume_at(live.stream), "resume")

        def write_initial_state(live: Calls, leaves: list[Any]) -> None:
            leaves = [jnp.asarray(x) for x in leaves]
            sharding = live.sharding
            live.stream.write_initial_state(
                sharding.block_map(leaves), sharding.devices(live.plan, leaves), sharding.kinds
            )

        return self._initialise(params, write_initial_state, "init")

    def init_from(self, params: Any, step: int, load: Callable[[int], tuple]) -> OffloadState:
        """Like :meth:`init`, but the tiers start at ``step`` with a given state (a checkpoint restore).

        The paths may hold no run, or this run (the same layout hash): restoring is the user's choice,
        so its state is discarded, with a warning naming the step it held.

        Args:
          params: the params, or their ``jax.ShapeDtypeStruct``s: only shapes and dtypes are used.
          step: the step the restored state is at.
          load: maps a subgroup index of :meth:`plan_for` ``(params)`` to its state leaves and master
            leaves (numpy arrays shaped as in its record layout); called once per subgroup, on
            reader threads.

        Returns:
          The :class:`OffloadState` at ``step``.
        """
        if self.resume:
            raise OffloadError("init_from writes a fresh state: create the mlp_offload without resume=True")
        return self._initialise(params, lambda live, _: live.stream.write_restored_state(step, load), "restore")

    def _initialise(
        self, params: Any, populate: Callable[[Calls, list[Any]], None], intent: resume.Intent
    ) -> OffloadState:
        """Plans, opens the tiers, checks what they hold against ``intent``, fills them with ``populate``,
        marks the paths."""
        accumulation.refuse_multisteps()
        if inputs.is_traced(params):
            raise OffloadError(
                "mlp_offload(...).init was called inside a jax transformation (jit, eval_shape, ...); call init "
                "eagerly on concrete params: it writes the initial optimizer state to storage"
            )
        if self._calls is not None:
            raise OffloadError("this mlp_offload was already initialised; create a new one for another model")
        self._check_open()
        planned = self._planned(params)
        config, plan = self.config, planned.plan
        paths = open_paths(
            config.paths,
            jax.process_index(),
            max_inflight=config.max_inflight,
            node_lock=config.node_lock,
            store_timeout=config.store_timeout,
        )
        stream = None
        try:
            resume.check_paths(paths, plan, config.subgroup_size, intent=intent)
            stream = planning.open_stream(self.inner, config, plan, paths, self._peer_key, self.on_stats, planned.notes)
            jit = JitRoute(plan, planned.sharding, planned.leaves, stream, config.peer_timeout)
            needs_params = planned.reads_params or plan.master_dtype is not None
            overlap = Overlap(config, plan, planned.sharding, stream, jit.layout, jit.unusable, needs_params)
            live = Calls(self.inner, config, plan, planned.sharding, stream, jit, overlap)
            populate(live, planned.leaves)
            for path in paths:
                path.write_run_file(resume.run_identity(plan, config.subgroup_size))
            if jax.process_count() > 1:
                peers.barrier(f"{self._peer_key}/init", config.peer_timeout, "the end of init")
        except BaseException:
            if stream is not None:
                stream.engine.close()
            release_paths(paths)  # a live offload holds them until close; a failed init lets go
            raise
        self._calls = live
        return live.first_handle(planned.leaves)

    def _initialised(self, verb: str | None = None) -> Calls:
        if self._calls is None:
            called = "" if verb is None else f".{verb} was called before init; "
            raise OffloadError(
                f"this mlp_offload{called or ' has not been initialised: '}call init (or restore a checkpoint) first"
            )
        return self._calls

    def _check_open(self) -> None:
        if self._closed:
            raise OffloadError("this mlp_offload is closed; create a new one (with resume=True to continue)")

    def flush(self) -> None:
        """Writes every dirty cached record to storage, so the tiers alone hold the newest step."""
        self._check_open()
        if self._calls is not None:
            self._calls.stream.flush()

    def pin(self) -> Pin:
        """Flushes, then pins the current step so it can be read beside training (a checkpoint save).

        A pinned record stays until :meth:`read_pinned` has read it or the pin is released: only a
        write or move that would overwrite or delete such a record waits (at most ``io_timeout``).

        Returns:
          The :class:`~jax_mlp.Pin`; call its ``release()`` when done, also on failure.
        """
        live = self._initialised()
        self._check_open()
        return live.stream.pin()

    def read_pinned(self, pin: Pin, index: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Subgroup ``index``'s state leaves and master leaves at the pinned step, verified, then unpinned.

        The arrays are views of a record that nothing writes to again. Safe to call from any thread.
        """
        return self._initialised().stream.tiers.read_pinned(pin, index)

    def set_caps(self, path: int | str, *, max_read: float | str | None = None, max_write: float | str | None = None):
        """Changes a path's bandwidth caps while training runs (e.g. to keep a shared PFS polite).

        Args:
          path: the path's index in ``paths``, or its name.
          max_read: the new read cap, e.g. ``"100MB/s"``; None removes it.
          max_write: the new write cap; None removes it.
        """
        caps = parse_rate(max_read, name="max_read"), parse_rate(max_write, name="max_write")
        self._initialised().stream.tiers.set_caps(path, *caps)

    def close(self, *, delete: bool = False) -> None:
        """Waits for queued jitted updates, flushes, stops the threads and, if ``delete``, removes the files."""
        if self._closed:
            return
        live = self._calls
        if live is not None:
            live.overlap_route.expect(None)  # a backward still running starts no update now
            live.jit.settle()
        try:
            if not delete:
                self.flush()
        finally:
            self._closed = True
            if live is not None:
                live.stream.close(delete=delete)

    # ----------------------------------------------------------------------------- update

    def update(
        self, updates: Any, state: OffloadState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, OffloadState]:
        """Streams every subgroup's state through the device and returns the inner optimizer's updates.

        Args:
          updates: the gradients, shaped as the params.
          state: the :class:`OffloadState` of the previous ``init`` or ``update``; its ``shared`` values
            (set by the user, perhaps) are what every subgroup starts from.
          params: the params; needed by optimizers that read them, and with ``master_dtype`` (with
            remainder masters they are the masters' high halves: the update starts from them).
          **extra_args: arrays passed to the inner optimizer's ``update`` (e.g. ``value=loss``), the
            same for every subgroup; a new combination is checked once (see :mod:`jax_mlp._src.plan.optimizer_check`).

        Called inside ``jax.jit``, it traces the in-jit route instead (see :mod:`jax_mlp._src.offload.in_jit`).
        With ``accumulate_steps=k``, only every k-th call streams, with the mean of the k calls' gradients.
        """
        return self._calls_for("update").update(updates, state, params, extra_args)

    def apply(self, grads: Any, state: OffloadState, params: Any, **extra_args: Any) -> tuple[Any, OffloadState]:
        """The fused ``update`` plus ``optax.apply_updates``: the new params, written over the old ones.

        Each subgroup's program writes its new param blocks into the donated param buffers (whole
        leaves by donation, row chunks in place), and each gradient leaf is deleted once its last
        subgroup has used it: beside params and grads, the device holds about one subgroup's state
        and the writes in flight, never a tree of updates or a second copy of the params. The result
        is ``update`` plus ``apply_updates``: with ``master_dtype`` bitwise (the new master's word),
        without it within the core tolerance (XLA fuses ``p + u`` into the update's arithmetic).

        ``params`` and ``grads`` are consumed, as in a jitted step that donates them: do not use them
        afterwards. Should the update fail, the offloaded state stays at the previous step, but the
        params may be partly updated: restore a checkpoint (with ``master_dtype`` and
        ``master_storage="full"``, :func:`jax_mlp.restore_params` gives them back from the tiers).

        Args:
          grads: the gradients, shaped as the params (after any stateless global transformation,
            e.g. ``optax.clip_by_global_norm``, applied by the caller).
          state: the :class:`OffloadState` of the previous ``init``, ``update`` or ``apply``.
          params: the params; each leaf must be its own array, not one of the grads.
          **extra_args: as for :meth:`update`.

        Returns:
          The new params (with the params' shardings) and the new :class:`OffloadState`.

        Raises:
          OffloadError: called inside ``jax.jit`` (use ``update`` and ``optax.apply_updates`` there),
            or an array is given twice among params and grads.
        """
        return self._calls_for("apply").apply(grads, state, params, extra_args)

    def overlap(self, params: Any) -> Any:
        """The identity on ``params``, whose backward starts the next update as it makes the grads.

        Apply it to the params inside the loss of a jitted grad step and call :meth:`update` after it,
        as usual: each subgroup streams as soon as the backward has made its grads, and ``update``
        finishes the step with the grads it is given, bitwise as without overlap (or, if they differ,
        by undoing the early work and streaming the step again: ``stats.rolled_back``). See
        docs/usage.md, "Overlapping the update with the backward pass".

        Args:
          params: the whole param tree, as given to ``init`` (traced: inside the loss).

        Returns:
          ``params``, unchanged.
        """
        return self._calls_for("overlap").overlap(params)

    def _calls_for(self, verb: str) -> Calls:
        """The live state for a call of ``verb``, refusing one before ``init`` or after ``close``."""
        live = self._initialised(verb)
        self._check_open()
        return live
