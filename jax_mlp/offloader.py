"""The offloader: the lifecycle of one ``mlp_offload`` (init, resume, restore, update, flush, close).

It plans the subgroups, opens the paths, fills them (or finds the step to resume at) and hands
each update to its :class:`~jax_mlp.step.StateStream`: eagerly, or through the in-jit route when
``update`` is traced. A failed ``init`` leaves nothing behind but what it wrote, so it can be retried.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_mlp import accumulation, dependence, inputs, kernels, partition, peers, resume
from jax_mlp.config import OffloadConfig, parse_rate
from jax_mlp.errors import OffloadError
from jax_mlp.in_jit import JitRoute
from jax_mlp.kernels import Uniform
from jax_mlp.partition import Plan
from jax_mlp.placement import LeafPlacement
from jax_mlp.scheduler import Scheduler
from jax_mlp.stats import UpdateStats
from jax_mlp.step import EAGER, Blocks, StateStream
from jax_mlp.storage.paths import open_paths, release_paths
from jax_mlp.storage.tier_stack import Pin

_INSTANCES = itertools.count()  # names this process's offloaders alike in every process, for barriers


class OffloadState(NamedTuple):
    """The optimizer state the user holds: the number of updates applied, and the shared state.

    The inner optimizer's state is in the tiers; ``step`` ties this handle to the step they hold.
    ``shared`` is the part of the inner state that every subgroup holds alike: ``inner.init`` of
    the params with ``None`` for every leaf (counts, injected hyperparameters; None before ``init``).
    Read it to log it; replace a value between updates (``state.hyperparams["learning_rate"] = 1e-4``)
    and the next update gives it to every subgroup. With ``accumulate_steps > 1`` it also carries the
    accumulation window, on the device.

    Attributes:
      step: the updates applied so far (int32 scalar).
      shared: the shared inner state (see above).
      mini_step: the calls accumulated since the last update, or None without accumulation.
      acc_grads: the running mean of those calls' gradients, a tree like the params in
        ``accumulator_dtype``, or None without accumulation.
    """

    step: jax.Array
    shared: Any = None
    mini_step: jax.Array | None = None
    acc_grads: Any = None

    @property
    def hyperparams(self) -> dict[str, Any]:
        """The injected hyperparameters of an ``optax.inject_hyperparams`` inner optimizer, as in optax."""
        if not hasattr(self.shared, "hyperparams"):
            raise AttributeError(
                "this OffloadState has no hyperparams: the inner optimizer is not made with optax.inject_hyperparams"
            )
        return self.shared.hyperparams


class _Live(NamedTuple):
    """What an initialised offloader runs with."""

    plan: Plan
    placement: LeafPlacement
    stream: StateStream
    jit: JitRoute


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
        self._run_key = f"jax_mlp/{next(_INSTANCES)}"
        self._live: _Live | None = None
        self._closed = False
        self._checked_extra_args = {config.extra_args}  # signatures the optimizer check has passed

    # ----------------------------------------------------------------------------- read-only views

    @property
    def plan(self) -> Plan | None:
        """The subgroups, or None before ``init``."""
        return None if self._live is None else self._live.plan

    @property
    def placement(self) -> LeafPlacement:
        """Each leaf's sharding and owned shards, as at ``init``."""
        return self._require_live().placement

    @property
    def step(self) -> int:
        """The step the tiers hold (0 before ``init``)."""
        return 0 if self._live is None else self._live.stream.step

    @property
    def last_stats(self) -> UpdateStats | None:
        """Statistics of the last ``init`` or ``update``."""
        return None if self._live is None else self._live.stream.last_stats

    @property
    def scheduler(self) -> Scheduler:
        """The live placement and order policy (``placement``, ``speeds``, ``moves``)."""
        return self._require_live().stream.scheduler

    @property
    def stream(self) -> StateStream:
        """The live :class:`~jax_mlp.step.StateStream`: its ``tiers``, ``prefetched`` and ``programs``."""
        return self._require_live().stream

    @property
    def jit_route(self) -> JitRoute:
        """The in-jit route: its ``layout`` (mesh, specs, host device), or None where it cannot serve."""
        return self._require_live().jit

    # ----------------------------------------------------------------------------- lifecycle

    def init(self, params: Any) -> OffloadState:
        """Plans the subgroups and streams the inner optimizer's initial state out to the tiers.

        With ``resume=True`` it reopens the tiers at their last complete step instead. The paths are
        marked as holding this run (``run.json``) only once that has succeeded, so a failed ``init``
        can simply be retried.
        """
        if self.resume:
            return self._initialise(params, self._resume)
        leaves = [jnp.asarray(x) for x in jax.tree_util.tree_leaves(inputs.as_arrays(params))]
        return self._initialise(params, lambda live: live.stream.write_initial_state(leaves, live.placement))

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
        return self._initialise(params, lambda live: live.stream.write_restored_state(step, loader(live.plan)))

    def _initialise(self, params: Any, populate: Callable[[_Live], None]) -> OffloadState:
        """Plans, opens the tiers, fills them with ``populate``, marks the paths."""
        accumulation.refuse_multisteps()
        if inputs.is_traced(params):
            raise OffloadError(
                "mlp_offload(...).init was called inside a jax transformation (jit, eval_shape, ...); call init "
                "eagerly on concrete params: it writes the initial optimizer state to storage"
            )
        if self._live is not None:
            raise OffloadError("this mlp_offload was already initialised; create a new one for another model")
        self._check_open()
        params = inputs.as_arrays(params)
        inputs.check_has_leaves(params)
        leaves = jax.tree_util.tree_leaves(params)
        placement = LeafPlacement.of(leaves)
        config = self.config
        check = dependence.check_optimizer(self.inner, params, config.master_dtype, dict(config.extra_args))
        plan = partition.make_plan(
            params,
            self.inner,
            config.subgroup_size,
            config.master_dtype,
            placement.shards,
            whole_leaves=check.whole_leaves,
        )
        oversized = partition.oversized_whole_leaves(plan, check.whole_leaves, config.subgroup_size)
        _warn_of(oversized, plan, config.subgroup_size)
        notes = {"check_s": check.seconds, "whole_leaf_subgroups": oversized}
        paths = open_paths(
            config.paths, jax.process_index(), max_inflight=config.max_inflight, node_lock=config.node_lock
        )
        stream = None
        try:
            resume.check_paths(paths, plan, resume=self.resume)
            stream = StateStream(
                self.inner, config, plan, paths, run_key=self._run_key, on_stats=self.on_stats, init_notes=notes
            )
            live = _Live(plan, placement, stream, JitRoute(plan, placement, leaves, stream, config.peer_timeout))
            populate(live)
            for path in paths:
                path.write_run_file(resume.run_identity(plan))
            if jax.process_count() > 1:
                peers.barrier(f"{self._run_key}/init", config.peer_timeout, "the end of init")
        except BaseException:
            if stream is not None:
                stream.engine.close()
            release_paths(paths)  # a live offload holds them until close; a failed init lets go
            raise
        self._live = live
        shared = jax.tree_util.tree_unflatten(_treedef(stream), [jnp.asarray(x) for x in stream.shared])
        return self._state_at(jnp.asarray(stream.step, jnp.int32), shared, plan, leaves)

    def _state_at(self, step: jax.Array, shared: Any, plan: Plan, params: list[Any]) -> OffloadState:
        """The handle at ``step``, with an empty accumulation window when accumulating."""
        if self.config.accumulate_steps == 1:
            return OffloadState(step, shared)
        window = accumulation.empty_window(params, self.config.accumulator_dtype)
        return OffloadState(
            step, shared, window.mini_step, jax.tree_util.tree_unflatten(plan.treedef, window.acc_grads)
        )

    def _resume(self, live: _Live) -> None:
        step, locations = resume.last_complete_step(
            live.stream.engine,
            live.stream.tiers.paths,
            live.plan,
            run_key=self._run_key,
            peer_timeout=self.config.peer_timeout,
        )
        live.stream.resume_at(step, locations)

    def _require_live(self) -> _Live:
        if self._live is None:
            raise OffloadError("this mlp_offload has not been initialised: call init (or restore a checkpoint) first")
        return self._live

    def _check_open(self) -> None:
        if self._closed:
            raise OffloadError("this mlp_offload is closed; create a new one (with resume=True to continue)")

    def flush(self) -> None:
        """Writes every dirty cached record to storage, so the tiers alone hold the newest step."""
        self._check_open()
        if self._live is not None:
            self._live.stream.flush()

    def pin(self) -> Pin:
        """Flushes, then pins the current step so it can be read beside training (a checkpoint save).

        A pinned record stays until :meth:`read_pinned` has read it or the pin is released: only a
        write or move that would overwrite or delete such a record waits (at most ``io_timeout``).

        Returns:
          The :class:`~jax_mlp.storage.tier_stack.Pin`; call its ``release()`` when done, also on failure.
        """
        live = self._require_live()
        self._check_open()
        return live.stream.pin()

    def read_pinned(self, pin: Pin, index: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Subgroup ``index``'s state leaves and master leaves at the pinned step, verified, then unpinned.

        The arrays are views of a record that nothing writes to again. Safe to call from any thread.
        """
        return self._require_live().stream.tiers.read_pinned(pin, index)

    def set_caps(self, path: int | str, *, max_read: float | str | None = None, max_write: float | str | None = None):
        """Changes a path's bandwidth caps while training runs (e.g. to keep a shared PFS polite).

        Args:
          path: the path's index in ``paths``, or its name.
          max_read: the new read cap, e.g. ``"100MB/s"``; None removes it.
          max_write: the new write cap; None removes it.
        """
        caps = parse_rate(max_read, name="max_read"), parse_rate(max_write, name="max_write")
        self._require_live().stream.tiers.set_caps(path, *caps)

    def close(self, *, delete: bool = False) -> None:
        """Waits for queued jitted updates, flushes, stops the threads and, if ``delete``, removes the files."""
        if self._closed:
            return
        live = self._live
        if live is not None:
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
          params: the params; needed by optimizers that read them, and with ``master_dtype``.
          **extra_args: arrays passed to the inner optimizer's ``update`` (e.g. ``value=loss``), the
            same for every subgroup; a new combination is checked once (see :mod:`jax_mlp.dependence`).

        Called inside ``jax.jit``, it traces the in-jit route instead (see :mod:`jax_mlp.in_jit`).
        With ``accumulate_steps=k``, only every k-th call streams, with the mean of the k calls' gradients.
        """
        live = self._check_state(state)
        grads, param_leaves = inputs.check_update_inputs(live.plan, updates, params)
        extra = self._checked_extra(live.plan, extra_args)
        shared = jax.tree_util.tree_unflatten(
            _treedef(live.stream), inputs.check_shared(live.stream.programs.shared_shapes, state.shared)
        )
        traced = inputs.is_traced((grads, state, param_leaves, extra))
        if traced:
            accumulation.refuse_multisteps()
        stream = functools.partial(self._stream, live, param_leaves=param_leaves, extra=extra, traced=traced)
        if self.config.accumulate_steps > 1:
            leaves, state = self._accumulate(live, grads, state, shared, stream, traced)
        else:
            leaves, step, shared = stream(grads, state.step, shared)
            state = OffloadState(step, shared)
        return jax.tree_util.tree_unflatten(live.plan.treedef, leaves), state

    def _accumulate(
        self, live: _Live, grads: list, state: OffloadState, shared: Any, stream: Callable, traced: bool
    ) -> tuple[list, OffloadState]:
        """One call of an accumulation window: folds the grads in; the window's last call streams their mean.

        Traced, the choice is a ``lax.cond``, so a micro-step never enters the host callback. The
        shared state moves on only with the update, as the inner state does in ``optax.MultiSteps``.
        """
        config, plan = self.config, live.plan
        window = accumulation.Window(state.mini_step, jax.tree_util.tree_leaves(state.acc_grads))
        means, carried = accumulation.add(grads, window, config.accumulator_dtype)
        full = window.mini_step >= config.accumulate_steps - 1
        dtypes = tuple(kernels.update_dtype(plan, i) for i in range(len(plan.leaves)))
        if traced:

            def update() -> tuple[list, Any]:
                leaves, _, new_shared = stream(means, state.step, shared)
                return leaves, new_shared

            leaves, shared = jax.lax.cond(full, update, lambda: (accumulation.zero_updates(grads, dtypes), shared))
            step, window = state.step + full.astype(jnp.int32), accumulation.restart_where(full, carried)
        elif not full:
            live.stream.check_step(int(state.step))
            live.stream.use_idle_window()
            leaves, step, window = accumulation.zero_updates(grads, dtypes), state.step, carried
        else:
            leaves, step, shared = stream(means, state.step, shared)
            window = accumulation.empty_window(carried.acc_grads, config.accumulator_dtype)
        return leaves, OffloadState(
            step, shared, window.mini_step, jax.tree_util.tree_unflatten(plan.treedef, window.acc_grads)
        )

    def _stream(
        self,
        live: _Live,
        grads: list,
        step: jax.Array,
        shared: Any,
        *,
        param_leaves: list | None,
        extra: dict,
        traced: bool,
    ) -> tuple[list, jax.Array, Any]:
        """One update from ``step``: the update leaves, the new step and the new shared state.

        Eagerly, or by the in-jit route when traced.
        """
        new_shared = live.stream.programs.shared_update(shared, extra)
        uniform = Uniform(tuple(jax.tree_util.tree_leaves(shared)), tuple(jax.tree_util.tree_leaves(new_shared)), extra)
        if traced:
            return live.jit.trace(grads, param_leaves, step, uniform), step + 1, new_shared
        placement = live.placement
        home = placement.home(grads)
        grad_blocks = placement.blocks(grads)
        param_blocks = None if param_leaves is None else placement.blocks(param_leaves)
        blocks = Blocks(
            lambda p: grad_blocks[p.leaf][p.device],
            None if param_blocks is None else lambda p: param_blocks[p.leaf][p.device],
            lambda subgroup: placement.device_of(subgroup, home),
            uniform,
        )
        results = live.stream.run_step(int(step), blocks, EAGER)
        return placement.assemble(live.plan, results), jnp.asarray(live.stream.step, jnp.int32), new_shared

    def _checked_extra(self, plan: Plan, extra_args: dict[str, Any]) -> dict[str, jax.Array]:
        """The extra arguments as arrays; the optimizer is checked with each new combination of their shapes."""
        extra = inputs.extra_arrays(extra_args)
        signature = tuple(sorted((k, jax.ShapeDtypeStruct(v.shape, v.dtype)) for k, v in extra.items()))
        if signature not in self._checked_extra_args:
            dependence.check_extra_args(self.inner, plan, extra)
            self._checked_extra_args.add(signature)
        return extra

    def _check_state(self, state: Any) -> _Live:
        if not isinstance(state, OffloadState):
            raise TypeError(
                f"mlp_offload.update expects the OffloadState returned by its init, got {type(state).__name__}"
            )
        if self._live is None:
            raise OffloadError("mlp_offload.update was called before init")
        self._check_open()
        accumulating = self.config.accumulate_steps > 1
        if accumulating != (state.mini_step is not None and state.acc_grads is not None):
            have = "has no accumulation window" if accumulating else "carries an accumulation window"
            raise OffloadError(
                f"this mlp_offload has accumulate_steps={self.config.accumulate_steps}, but the opt_state passed to "
                f"update {have}: pass the OffloadState that this mlp_offload's init (or restore) returned"
            )
        return self._live


def _treedef(stream: StateStream) -> Any:
    return jax.tree_util.tree_structure(stream.programs.shared_shapes)


def _warn_of(oversized: dict[str, int], plan: Plan, subgroup_size: int) -> None:
    for leaf, index in oversized.items():
        warnings.warn(
            f"param {leaf} is kept whole in subgroup {index}, of {plan.subgroups[index].layout.nbytes} bytes, above "
            f"subgroup_size={subgroup_size}: its optimizer mixes its rows (adafactor, lamb, lars and muon do), so "
            "cutting it into row chunks would change the math. Expect that subgroup to take more memory and time",
            stacklevel=4,
        )
