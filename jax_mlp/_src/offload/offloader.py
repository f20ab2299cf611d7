"""The offloader: the lifecycle of one ``mlp_offload`` (init, resume, restore, flush, pin, close), and the
choice of route for each call.

It plans the subgroups, opens the paths, builds the state stream and the routes (a :class:`Live`),
fills the tiers (or finds the step to resume at), and hands each ``update`` and ``apply``, once
checked, to the route the call takes (``offload/route.py``). After every route it tells the overlap
what the next backward may assume, from the route's outcome; before any other use of the stream it
settles an update the backward started. A failed ``init`` leaves nothing behind but what it wrote,
so it can be retried. Users hold it through ``OffloadTransformation`` (``transform.py``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_mlp._src import peers
from jax_mlp._src.config import OffloadConfig
from jax_mlp._src.errors import OffloadError
from jax_mlp._src.offload import inputs, planning, resume, window
from jax_mlp._src.offload.accumulation import AccumulationRoute
from jax_mlp._src.offload.fused import FusedRoute
from jax_mlp._src.offload.in_jit import JitRoute
from jax_mlp._src.offload.overlap import Overlap
from jax_mlp._src.offload.route import Call, Calls, Parts, Route
from jax_mlp._src.offload.split import SplitRoute
from jax_mlp._src.parsing import parse_rate
from jax_mlp._src.plan.callback_layout import callback_layout
from jax_mlp._src.plan.partition import LeafOrder, Plan
from jax_mlp._src.plan.sharding import LeafSharding
from jax_mlp._src.state import OffloadState
from jax_mlp._src.storage.paths import open_configured, release_paths
from jax_mlp._src.storage.tier_stack import Pin
from jax_mlp._src.stream.build import build_stream
from jax_mlp._src.stream.state_stream import StateStream

_INSTANCES = itertools.count()  # names this process's offloaders alike in every process, for barriers


class Live(NamedTuple):
    """An initialised offload: what its routes are built from, and one object per route.

    Attributes:
      parts: the call checks, options, plan, sharding, state stream and overlap.
      split: eager updates, and the finish of overlapped ones.
      fused: ``apply``.
      in_jit: ``update`` traced inside ``jax.jit``.
      accumulation: the calls of an accumulation window.
    """

    parts: Parts
    split: SplitRoute
    fused: FusedRoute
    in_jit: JitRoute
    accumulation: AccumulationRoute

    @property
    def plan(self) -> Plan:
        return self.parts.plan

    @property
    def sharding(self) -> LeafSharding:
        return self.parts.sharding

    @property
    def stream(self) -> StateStream:
        return self.parts.stream

    @property
    def overlap(self) -> Overlap:
        return self.parts.overlap

    def route_for(self, call: Call, accumulate_steps: int) -> Route:
        """The route ``call`` takes: the table of docs/architecture.md, "Routes"."""
        if call.verb == "apply":
            return self.fused
        if call.traced:
            return self.in_jit
        if accumulate_steps > 1:
            return self.accumulation
        return self.split


class ClosesOnExit:
    """A context manager that returns itself and calls ``self.close()`` on exit, also on an exception."""

    __slots__ = ()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class Offloader(ClosesOnExit):
    """The live object behind ``mlp_offload``: plan, tiers, threads, compiled programs and routes.

    Private: users hold the ``OffloadTransformation`` that :func:`~jax_mlp.mlp_offload` returns, whose
    ``init`` and ``update`` are this object's bound methods and whose other verbs call it.

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
        on_stats: Callable[[Any], None] | None = None,
    ):
        self.inner = optax.with_extra_args_support(inner)
        self.config = config
        self.resume = resume
        self.on_stats = on_stats
        self._peer_key = f"jax_mlp/{next(_INSTANCES)}"
        self.live: Live | None = None
        self._closed = False
        self._last_plan: planning.Planned | None = None

    # ----------------------------------------------------------------------------- lifecycle

    def plan_for(self, params: Any) -> Plan:
        """The subgroups ``init`` gives these params (their shapes and dtypes), after the optimizer check.

        ``init`` and :meth:`init_from` reuse it, so a restore can read its checkpoint by the plan first.
        """
        return self._planned(params).plan

    def _planned(self, params: Any, leaf_order: LeafOrder = "natural") -> planning.Planned:
        inputs.check_has_leaves(params)
        inputs.check_float_leaves(params)
        leaves = jax.tree_util.tree_leaves(params)
        inputs.check_master_dtype(leaves, self.config.master_dtype)
        inputs.check_param_memory(params, self.config.accumulate_steps)
        key = (jax.tree_util.tree_structure(params), tuple(planning.signature(x) for x in leaves), leaf_order)
        if self._last_plan is None or self._last_plan.key != key:
            self._last_plan = planning.plan_params(self.inner, self.config, params, key, leaf_order=leaf_order)
        return self._last_plan._replace(leaves=leaves)

    def init(self, params: Any) -> OffloadState:
        """Plans the subgroups and streams the inner optimizer's initial state out (with ``resume``, reopens the
        tiers at their last complete step); the paths are marked as holding this run only once that succeeded."""
        if self.resume:
            resume_at = functools.partial(resume.resume_at, peer_key=self._peer_key)
            return self._initialise(params, lambda live, _: resume_at(live.stream), "resume")

        def write_initial_state(live: Live, leaves: list[Any]) -> None:
            leaves = [jnp.asarray(x) for x in leaves]
            sharding = live.sharding
            live.stream.write_initial_state(
                sharding.block_map(leaves), sharding.devices(live.plan, leaves), sharding.kinds
            )

        return self._initialise(params, write_initial_state, "init")

    def init_from(self, params: Any, step: int, load: Callable[[int], tuple]) -> OffloadState:
        """Like :meth:`init`, but the tiers start at ``step`` with the state ``load(k)`` gives each subgroup k of
        :meth:`plan_for` ``(params)`` (a checkpoint restore; called on reader threads).

        The paths may hold no run, or this run (the same layout hash): restoring is the user's choice,
        so its state is discarded, with a warning naming the step it held.
        """
        if self.resume:
            raise OffloadError("init_from writes a fresh state: create the mlp_offload without resume=True")
        return self._initialise(params, lambda live, _: live.stream.write_restored_state(step, load), "restore")

    def _initialise(
        self, params: Any, populate: Callable[[Live, list[Any]], None], intent: resume.Intent
    ) -> OffloadState:
        """Plans, opens the tiers, checks what they hold against ``intent``, fills them with ``populate``,
        marks the paths."""
        window.refuse_multisteps()
        if inputs.is_traced(params):
            raise OffloadError(
                "mlp_offload(...).init was called inside a jax transformation (jit, eval_shape, ...); call init "
                "eagerly on concrete params: it writes the initial optimizer state to storage"
            )
        if self.live is not None:
            raise OffloadError("this mlp_offload was already initialised; create a new one for another model")
        self._check_open()
        planned, config = self._planned(params), self.config
        paths = open_configured(config)
        stream = None
        try:
            if intent == "resume":  # a run planned before 0.3 packs its leaves in tree order
                planned = self._planned(params, resume.held_leaf_order(paths))
            plan = planned.plan
            resume.check_paths(paths, plan, config.subgroup_size, intent=intent)
            stream = build_stream(self.inner, config, plan, paths, self._peer_key, self.on_stats, planned.notes)
            live = self._routes(planned, stream)
            populate(live, planned.leaves)
            for path in paths:
                path.write_run_file(resume.run_identity(plan, config.subgroup_size))
            peers.barrier(f"{self._peer_key}/init", config.peer_timeout, "the end of init")
        except BaseException:
            if stream is not None:
                stream.engine.close()
            release_paths(paths)  # a live offload holds them until close; a failed init lets go
            raise
        self.live = live
        return self._first_handle(live, planned.leaves)

    def _routes(self, planned: planning.Planned, stream: StateStream) -> Live:
        """The call checks and one object per route, for ``planned`` streamed by ``stream``."""
        config, plan, sharding = self.config, planned.plan, planned.sharding
        calls = Calls(self.inner, config, plan, sharding, stream.programs)
        try:
            layout, unusable = callback_layout([spec.path for spec in plan.leaves], planned.leaves), None
        except OffloadError as error:
            layout, unusable = None, str(error)
        needs_params = planned.reads_params or plan.master_dtype is not None
        overlap = Overlap(config, plan, sharding, stream, layout, unusable, needs_params)
        parts = Parts(calls, config, plan, sharding, stream, overlap, needs_params)
        split = SplitRoute(parts)
        return Live(parts, split, FusedRoute(parts), JitRoute(parts, layout, unusable), AccumulationRoute(parts, split))

    def _first_handle(self, live: Live, params: list[Any]) -> OffloadState:
        """The handle at the step the tiers were filled at (an empty accumulation window, if accumulating)."""
        shared = live.parts.calls.shared_of([jnp.asarray(x) for x in live.stream.shared])
        step = jnp.asarray(live.stream.step, jnp.int32)
        if self.config.accumulate_steps > 1:
            empty = window.empty_window(params, self.config.accumulator_dtype)
            acc_grads = jax.tree_util.tree_unflatten(inputs.bare_treedef(live.plan.treedef), empty.acc_grads)
            return OffloadState(step, shared, empty.mini_step, acc_grads)
        live.overlap.expect(live.overlap.basis(params, shared), params)
        return OffloadState(step, shared)

    def initialised(self, verb: str | None = None) -> Live:
        """The live offload, refusing a call of ``verb`` before ``init`` or after ``close``."""
        if self.live is None:
            called = "" if verb is None else f".{verb} was called before init; "
            raise OffloadError(
                f"this mlp_offload{called or ' has not been initialised: '}call init (or restore a checkpoint) first"
            )
        self._check_open()
        return self.live

    def _check_open(self) -> None:
        if self._closed:
            raise OffloadError("this mlp_offload is closed; create a new one (with resume=True to continue)")

    def flush(self) -> None:
        """Writes every dirty cached record to storage (a no-op before ``init``)."""
        self._check_open()
        if self.live is not None:
            self.live.overlap.interrupted()
            self.live.overlap.settle()
            self.live.stream.flush()

    def pin(self) -> Pin:
        """Flushes, then pins the current step so it can be read beside training (a checkpoint save)."""
        live = self.initialised()
        live.overlap.interrupted()
        live.overlap.settle()
        return live.stream.pin()

    def read_pinned(self, pin: Pin, index: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Subgroup ``index``'s state leaves and master leaves at the pinned step, verified, then unpinned."""
        if self.live is None:
            raise OffloadError("read_pinned needs an initialised mlp_offload and a pin it gave")
        return self.live.stream.tiers.read_pinned(pin, index)

    def set_caps(self, path: int | str, *, max_read: float | str | None = None, max_write: float | str | None = None):
        """Changes a path's bandwidth caps while training runs."""
        caps = parse_rate(max_read, name="max_read"), parse_rate(max_write, name="max_write")
        self.initialised().stream.tiers.set_caps(path, *caps)

    def close(self, *, delete: bool = False) -> None:
        """Settles the overlap and the jitted updates still queued, flushes (unless ``delete``), stops the threads
        and, with ``delete``, removes the files."""
        if self._closed:
            return
        live = self.live
        if live is not None:
            live.overlap.expect(None)  # a backward still running starts no update now
            live.overlap.settle()
            live.in_jit.settle()
        try:
            if not delete:
                self.flush()
        finally:
            self._closed = True
            if live is not None:
                live.stream.close(delete=delete)

    # ----------------------------------------------------------------------------- calls

    def update(
        self, updates: Any, state: OffloadState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, OffloadState]:
        """``update`` of the transformation: see ``OffloadTransformation.update``."""
        return self._call("update", updates, state, params, extra_args)

    def apply(self, grads: Any, state: OffloadState, params: Any, **extra_args: Any) -> tuple[Any, OffloadState]:
        """``apply`` of the transformation: see ``OffloadTransformation.apply``."""
        return self._call("apply", grads, state, params, extra_args)

    def _call(self, verb: str, grads: Any, state: Any, params: Any, extra_args: dict) -> tuple[Any, OffloadState]:
        """Checks a call, runs it through its route, and tells the overlap what the next backward may assume."""
        live = self.initialised(verb)
        call = live.parts.calls.check(verb, grads, state, params, extra_args)
        del grads, params  # apply consumes them: the call holds its leaves
        try:
            outcome = live.route_for(call, self.config.accumulate_steps).run(call)
        except BaseException:
            live.overlap.interrupted()
            live.overlap.expect(None)
            raise
        live.overlap.expect(outcome.expect, call.grads)
        return outcome.result()

    def overlap(self, params: Any) -> Any:
        """``overlap`` of the transformation (traced: inside the loss)."""
        live = self.initialised("overlap")
        return live.overlap(params)
