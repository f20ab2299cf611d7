"""The layer-streamed step: a model larger than host RAM, its params, grads and optimizer state all in the tiers.

The model is a stack of identical layers between outer params (:class:`LayerStack`: ``embed``,
``layer`` and ``head``, pure functions of params and activations). Each step is a host-driven loop
of jitted per-layer programs, with no callbacks:

- **forward**, layer by layer: each unit's params come from its params records (host cache first),
  read ahead while the previous layer computes; each layer's input is kept (on the device, or in
  ``pinned_host`` with ``activations="pinned_host"``); a layer sharded over devices is read shard by
  shard onto its devices and assembled with its sharding;
- **backward**, in reverse, recomputing inside each layer (``jax.vjp`` of the layer on its kept
  input); the last layer's params are the forward's, each earlier layer's are read again, one layer
  ahead, beside the update's state (nothing is read between steps: :func:`stream_config`);
- **update**, during the backward: the grads of a unit go to the update by a plain call as soon as
  its backward program returns. The update is one transaction of the state stream on its own thread,
  in the backward's order; each subgroup's fused apply program writes its new state record and its
  new params record to the slot the tiers' step does not hold, so a crash anywhere leaves the last
  committed step whole: its state and its params;
- **commit**, in the next step's forward: the step returns once the backward has handed its last unit
  over, and the update's last writes run on into the next forward, which takes the first units
  (:data:`FRESH_UNITS`) as the update made them, reads the others once written, and commits the step
  before its own update begins.

With ``max_grad_norm`` the grads are clipped as ``optax.clip_by_global_norm`` clips them. The norm is
known only once the backward ends, so by default (``clipping="speculate"``) the update runs on the
unclipped grads; if the clipping fires, the transaction is undone (nothing committed) and the backward
runs again with the grads scaled. With ``clipping="defer"`` the backward stores each unit's grads in
its grads records instead, and the update runs in the next step's forward, in the forward's order,
each unit's new params going straight to the forward (the outer params, then the layers), committed
once the forward's last layer is updated. Gradient accumulation is layer-major: each layer runs all ``microbatches`` before the
next, so its params are read once per step, and its grads are summed in micro-batch order.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_mlp._src import host_memory, peers
from jax_mlp._src.config import OffloadConfig
from jax_mlp._src.errors import OffloadError
from jax_mlp._src.offload import inputs, planning, resume, window
from jax_mlp._src.offload.offloader import ClosesOnExit
from jax_mlp._src.plan import layers as layer_plans
from jax_mlp._src.plan.layer_programs import (
    LayerPrograms,
    LayerStack,
    check_closure,
    clipped,
    micro_mean,
    split_batch,
    squares,
)
from jax_mlp._src.plan.layers import LayerPlan, Unit, check_host_memory, stream_config, update_order
from jax_mlp._src.plan.partition import Piece
from jax_mlp._src.plan.programs import Uniform
from jax_mlp._src.state import OffloadState
from jax_mlp._src.stats import UpdateStats
from jax_mlp._src.storage.paths import open_configured, release_paths
from jax_mlp._src.storage.tier_stack import Pin
from jax_mlp._src.stream import kept_inputs
from jax_mlp._src.stream.build import build_stream
from jax_mlp._src.stream.kept_inputs import KeptInputs
from jax_mlp._src.stream.layer_update import LayerUpdate
from jax_mlp._src.stream.state_stream import StateStream
from jax_mlp._src.stream.unit_reads import UnitReads


class LayerStream(ClosesOnExit):
    """A layer-streamed model's training: :meth:`init` fills the tiers, :meth:`step` runs one training step.

    A step returns with its update still writing (with ``clipping="defer"``, not yet run); the next step's
    forward finishes and commits it, and so do ``flush``, ``close``, ``params``, ``unit_params`` and ``pin`` (a
    checkpoint save) first.

    Made by :func:`stream_layers`. Its params, grads and optimizer state live in the tiers; host RAM
    holds the cache and a few units' staging, the device about two units' params, one unit's grads and
    the layers' inputs.
    """

    def __init__(
        self,
        stack: LayerStack,
        inner: optax.GradientTransformation,
        config: OffloadConfig,
        *,
        max_grad_norm: float | None,
        clipping: Literal["speculate", "defer"],
        microbatches: int,
        activations: Literal["device", "pinned_host"] | os.PathLike,
        resume: bool,
        on_stats: Callable[[UpdateStats], None] | None,
    ):
        if clipping not in CLIPPINGS:
            raise OffloadError(
                f"clipping must be one of {', '.join(map(repr, CLIPPINGS))} (when a clipped step's update runs), "
                f"got {clipping!r}"
            )
        if clipping == "defer" and max_grad_norm is None:
            raise OffloadError(
                "clipping='defer' holds each update back until the global norm of the grads is known, for "
                "max_grad_norm; without max_grad_norm there is nothing to wait for: leave clipping at its default"
            )
        if microbatches < 1:
            raise OffloadError(f"microbatches must be at least 1, got {microbatches}")
        kept_inputs.check_where(activations)
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise OffloadError(f"max_grad_norm must be positive, got {max_grad_norm}")
        if config.accumulate_steps > 1:
            raise OffloadError(
                "stream_layers accumulates layer by layer: pass microbatches=k instead of accumulate_steps"
            )
        self.stack = stack
        self.inner = optax.with_extra_args_support(inner)
        self.config = config
        self.max_grad_norm = max_grad_norm
        self.clipping = clipping
        self.microbatches = microbatches
        self.activations = activations
        self.resume = resume
        self.on_stats = on_stats
        self._jitted = LayerPrograms(stack)
        host_memory.return_large_buffers_to_the_os()
        self._plan: LayerPlan | None = None
        self._stream: StateStream | None = None
        self._reads: UnitReads | None = None  # once the tiers are open
        self._inputs: KeptInputs | None = None  # where the layers' inputs wait, once initialised
        self._writers = concurrent.futures.ThreadPoolExecutor(config.write_depth, thread_name_prefix="jax_mlp-grads")
        self._pending: _Pending | None = None  # the deferred update the next forward runs
        self._writing: LayerUpdate | None = None  # the update whose writes the next forward finishes
        self._device = jax.local_devices()[0]
        self._devices: list[jax.Device] = []  # per subgroup, once planned
        self._closed = False
        self.rolled_back = 0

    # ----------------------------------------------------------------------------- views

    @property
    def plan(self) -> LayerPlan | None:
        """The units, subgroups and records, or None before ``init``."""
        return self._plan

    @property
    def stats(self) -> UpdateStats | None:
        """The stats of the last ``init`` or ``step``."""
        return None if self._stream is None else self._stream.last_stats

    @property
    def step_count(self) -> int:
        """The step the tiers hold: one behind the handle until the next forward (or ``flush``) commits the last step."""
        return 0 if self._stream is None else self._stream.step

    @property
    def _defers(self) -> bool:
        return self.clipping == "defer"

    @property
    def _waiting(self) -> bool:
        """Whether the last step's update waits for the next forward (deferred, or still writing): the handle is
        then one step ahead of the tiers."""
        return self._pending is not None or self._writing is not None

    # ----------------------------------------------------------------------------- init

    def init(
        self,
        outer: Any,
        layers: Any = None,
        *,
        layer_init: Callable[[int], Any] | None = None,
        num_layers: int | None = None,
    ) -> OffloadState:
        """Plans the units and writes each layer's params and initial state into the tiers, one layer at a time.

        Args:
          outer: the outer params (embedding, head, ...), as arrays.
          layers: the layers' params stacked on axis 0 (``jax.Array`` s), or None with ``layer_init``.
          layer_init: ``layer_init(index) -> one layer's params``, called once per layer: a model larger
            than host RAM is initialised straight into the tiers.
          num_layers: the number of layers, with ``layer_init``.

        Returns:
          The handle at step 0 (or, with ``resume``, at the last complete step).
        """
        layer_of = self._layers_source(layers, layer_init, num_layers)
        plan = self.plan_for(outer, *layer_of.shapes)
        if self.resume:
            records = 2 * len(plan.plan.subgroups)  # state and params: grads records are never committed

            def resume_at() -> None:
                resume.resume_at(self._stream, peer_key="jax_mlp/layers", records=records)

            return self._initialise(plan, resume_at, "resume")
        return self._initialise(plan, lambda: self._write_initial_state(plan, _as_arrays(outer), layer_of), "init")

    def plan_for(self, outer: Any, one_layer: Any, num_layers: int) -> LayerPlan:
        """The plan ``init`` makes for these params (shapes are enough), after the checks that precede any write.

        Args:
          outer: the outer params, as arrays or ``jax.ShapeDtypeStruct``s.
          one_layer: one layer's params as shapes (with its sharding, where it spans devices).
          num_layers: the number of layers.
        """
        if self._stream is not None:
            raise OffloadError("this stream_layers was already initialised; create a new one for another model")
        self._check_open()
        window.refuse_multisteps()
        inputs.check_float_leaves(outer)
        check_closure(self.stack.layer)

        def make_plan(tree: Any, unit_of: Sequence[int]) -> Any:  # the optimizer check, then the subgroups
            # The units order the stream, and a unit's leaves share one subgroup: tree order, as ever.
            return planning.plan_params(self.inner, self.config, tree, None, unit_of, "tree").plan

        plan = layer_plans.make_layer_plan(outer, one_layer, num_layers, make_plan)
        check_host_memory(plan, self.config, self._device.platform)
        return plan

    def init_from(self, plan: LayerPlan, step: int, load: Callable[[int], tuple]) -> OffloadState:
        """Like :meth:`init`, but the tiers start at ``step`` with what ``load(k)`` gives each subgroup ``k`` of
        ``plan`` (from :meth:`plan_for`): its state, master and params leaves (a checkpoint restore).

        The paths may hold no run, or this run: restoring is the user's choice, so what they held is
        discarded, with a warning naming its step.
        """
        if self.resume:
            raise OffloadError("a restore writes a fresh state: create the stream_layers without resume=True")
        return self._initialise(plan, lambda: self._stream.write_restored_state(step, load), "restore")

    def _initialise(self, plan: LayerPlan, populate: Callable[[], None], intent: resume.Intent) -> OffloadState:
        """Opens the tiers, checks what they hold against ``intent``, fills them with ``populate``, marks the
        paths; then every process has done so."""
        self._inputs = KeptInputs(self.activations, self.config.write_depth)  # a bad directory: before the tiers
        try:
            self._open(plan, intent)
            populate()
            for path in self._stream.tiers.paths:
                path.write_run_file(resume.run_identity(plan.plan, self.config.subgroup_size))
            peers.barrier("jax_mlp/layers/init", self.config.peer_timeout, "the end of init")
        except BaseException:
            self._release(delete=False)
            self._reads, self._stream, self._inputs = None, None, None  # init may be called again
            raise
        stream = self._stream
        shared = [jnp.asarray(x) for x in stream.shared]
        treedef = jax.tree_util.tree_structure(stream.programs.shared_shapes)
        return OffloadState(jnp.asarray(stream.step, jnp.int32), jax.tree_util.tree_unflatten(treedef, shared))

    def _layers_source(self, layers: Any, layer_init: Callable[[int], Any] | None, num_layers: int | None):
        if (layers is None) == (layer_init is None):
            raise OffloadError("init takes the stacked layers' params or layer_init (with num_layers), one of them")
        if layers is not None:
            shapes = layer_plans.layer_shapes(layers, num_layers)
            return _Stacked(layers, shapes)
        if num_layers is None or num_layers < 1:
            raise OffloadError("init with layer_init needs num_layers, the number of layers (at least 1)")
        return _Initialised(layer_init, num_layers)

    def _open(self, plan: LayerPlan, intent: resume.Intent) -> None:
        config = self.config
        paths = open_configured(config)
        try:
            resume.check_paths(paths, plan.plan, config.subgroup_size, intent=intent)
            stream = build_stream(
                self.inner,
                stream_config(plan, config),
                plan.plan,
                paths,
                "jax_mlp/layers",
                self.on_stats,
                {},
                plan.param_layouts * (2 if self._defers else 1),  # the grads records too, where the update waits
            )
        except BaseException:
            release_paths(paths)
            raise
        stream.scheduler.follow(update_order(plan, deferred=self._defers))
        self._plan, self._stream, self._devices = plan, stream, plan.devices(self._device)
        self._reads = UnitReads(plan, stream, self._devices, config.prefetch_depth)

    def _write_initial_state(self, plan: LayerPlan, outer: Any, layer_of: Any) -> None:
        """Each subgroup's initial state and its params, computed from its unit's params (made once per unit)."""
        stream = self._stream
        unit_of_subgroup = {k: u for u, unit in enumerate(plan.units) for k in unit.subgroups}
        held: dict[int, dict] = {}

        def unit_blocks(u: int) -> dict:
            if u not in held:
                held.clear()
                tree = outer if u == plan.num_layers else layer_of.layer(u)
                held[u] = self._blocks(plan.units[u], jax.tree_util.tree_leaves(tree))
            return held[u]

        def compute(index: int, _: Any) -> tuple:
            subgroup = plan.plan.subgroups[index]
            placed = unit_blocks(unit_of_subgroup[index])
            blocks = [placed[p.leaf, p.device] for p in subgroup.pieces]
            state, masters = stream.programs.init(subgroup, blocks, self._devices[index])
            return state, masters, _pieces_of(subgroup.pieces, blocks)

        stream.write_populated(0, compute)

    def _blocks(self, unit: Unit, leaves: Sequence[Any]) -> dict:
        """A unit's leaves as blocks by (leaf, device id): a leaf on one device on the stream's, a sharded one's
        shards as its plan shards it."""
        shardings = self._plan.sharding.shardings
        placed = [
            jax.device_put(jnp.asarray(x), self._device) if shardings[i] is None else x
            for i, x in zip(unit.leaves, leaves, strict=True)
        ]
        return self._plan.sharding.block_map(placed, unit.leaves)

    # ----------------------------------------------------------------------------- the step

    def _tree(self, unit: Unit, leaves: Sequence[jax.Array]) -> Any:
        plan = self._plan
        treedef = plan.outer_treedef if unit is plan.outer else plan.layer_treedef
        return jax.tree_util.tree_unflatten(treedef, list(leaves))

    def _keys(self, *units: Unit) -> list[tuple]:
        """The update's block keys (leaf, device) of ``units``, in plan order."""
        subgroups = self._plan.plan.subgroups
        return list(
            dict.fromkeys((p.leaf, p.device) for unit in units for k in unit.subgroups for p in subgroups[k].pieces)
        )

    def step(self, state: OffloadState, batch: Any) -> tuple[jax.Array, OffloadState]:
        """One training step: forward, backward and update, layer by layer; returns the loss and the new handle.

        Args:
          state: the handle ``init`` or the previous ``step`` returned.
          batch: the step's batch (a pytree whose leaves have the batch on axis 0, divisible by ``microbatches``).

        Returns:
          The loss (the mean over micro-batches) and the handle at the next step.

        Raises:
          OffloadError: before ``init``, after ``close``, or for a handle of another step; the tiers then
            keep the step they held. Also when the last step's update failed to write its records (a full
            disk): naming the path and the step the tiers hold, whose handle runs the failed step again.
        """
        if self._stream is None:
            raise OffloadError("stream_layers.step was called before init: call init first")
        self._check_open()
        stream, plan = self._stream, self._plan
        step = int(state.step)
        pending, writing = self._pending, self._writing
        stream.check_step(step - self._waiting)
        micro = split_batch(batch, self.microbatches)
        shared = inputs.check_shared(stream.programs.shared_shapes, state.shared)
        shared_tree = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(stream.programs.shared_shapes), shared)
        new_shared = stream.programs.shared_update(shared_tree, {})
        leaves = jax.tree_util.tree_leaves
        uniform = Uniform(tuple(leaves(shared_tree)), tuple(leaves(new_shared)), {})

        units = [plan.outer, *plan.units[:-1]]
        update = None
        scale = None
        try:
            if pending is not None:  # the last step's deferred update, each unit's just before the forward uses it
                update = self._new_update(pending.uniform, fresh=self._keys(*units))
                ahead = self._applied(update, pending.scale, units)
            elif writing is not None:  # the last step's update still writing: its first units as it made them
                ahead = self._written(writing, units)
            else:
                ahead = self._reads.ahead(units, functools.partial(self._reads.params, step=stream.step))
            outer = self._tree(plan.outer, next(ahead))
            xs = [self._jitted.embed(outer, b) for b in micro]
            kept: list[list[Any]] = []
            for index, unit in enumerate(units[1:]):
                last = next(ahead)  # the last layer's stay on the device for the backward's first
                if index == len(units) - 2 and pending is None and not self._defers:  # the update's reads begin
                    if writing is not None:  # every read of this forward is done: the last step's writes are too
                        self._end_writing(writing)
                        writing = None
                    update = self._new_update(uniform, fresh=self._keys(*units[:FRESH_UNITS]))
                kept.append(self._inputs.keep(index, xs))
                xs = [self._jitted.layer(self._tree(unit, last), x) for x in xs]
                kept_inputs.wait(kept[-1])  # one layer computing, one dispatched: dispatch runs no further ahead
            if pending is not None:  # the deferred update is whole: commit it
                update.commit()
                self._pending, update = None, None
            losses, head_grads, gys = [], [], []
            for x, b in zip(xs, micro, strict=True):
                loss, (g_outer, gy) = self._jitted.head(outer, x, b)
                losses.append(loss)
                head_grads.append(g_outer)
                gys.append(gy)
            del xs
            if self._defers:
                sums = self._backward(self._storer(), micro, kept, head_grads, gys, last)
                self._pending = _Pending(self._scale(sums), uniform)
            else:
                sums = self._backward(self._giver(update, None), micro, kept, head_grads, gys, last)
                if self.max_grad_norm is not None and (scale := self._scale(sums)) is not None:
                    update.abort("the clipping fired: the step is redone with the clipped grads")
                    self.rolled_back += 1
                    update = self._new_update(uniform, fresh=self._keys(*units[:FRESH_UNITS]), redone=True)
                    self._backward(self._giver(update, scale), micro, kept, head_grads, gys, None)
                self._writing, update = update, None  # its writes run into the next forward
        except BaseException:
            if update is not None:
                update.abort("the step failed")
            if self._writing is writing is not None:  # committed if its writes went through: the handle then holds
                self._end_writing(writing)
            raise
        loss = losses[0] if len(losses) == 1 else jnp.mean(jnp.stack(losses))
        return loss, OffloadState(jnp.asarray(stream.step + self._waiting, jnp.int32), new_shared)

    def _new_update(self, uniform: Uniform, *, fresh: Sequence[tuple] = (), redone: bool = False) -> LayerUpdate:
        timeout = self.config.io_timeout
        return LayerUpdate(self._stream, self._plan.plan, uniform, self._devices, timeout, fresh=fresh, redone=redone)

    def _end_writing(self, writing: LayerUpdate) -> None:
        """Commits the last step's update once its writes are done; if they failed, undoes it and says what the
        tiers hold."""
        self._writing = None
        try:
            writing.commit()
        except Exception as error:
            writing.abort("its writes failed")
            step = self._stream.step
            raise OffloadError(
                f"the update of step {step + 1} failed while writing its records ({error}); the tiers hold step "
                f"{step}: fix the cause, then run step {step + 1} again from step {step}'s handle (the one the step "
                "before it returned) or from stream_layers(..., resume=True)"
            ) from error
        except BaseException:
            writing.abort("interrupted")
            raise

    def _written(self, update: LayerUpdate, units: Sequence[Unit]) -> Iterator[list]:
        """Each unit's params after ``update``, whose writes still run: the first units' as it made them, the
        others read from its records, each once written."""
        step = self._stream.step + 1
        read = functools.partial(self._reads.params, step=step, written=update.wait_stored)
        reads = self._reads.ahead(units[FRESH_UNITS:], read)
        for unit in units[:FRESH_UNITS]:
            yield self._fresh(update, unit)
        yield from reads

    def _fresh(self, update: LayerUpdate, unit: Unit) -> list:
        """``unit``'s new params as ``update`` made them (waiting for them), assembled with their shardings."""
        return self._plan.sharding.assemble(self._plan.plan, update.take_fresh(self._keys(unit)), unit.leaves)

    def _scale(self, sums: dict[int, jax.Array]) -> jax.Array | None:
        """The global norm the grads are scaled by (as ``clip_by_global_norm`` scales them), or None: no clipping."""
        if self.max_grad_norm is None:
            return None
        norm = jnp.sqrt(sum(sums[i] for i in range(len(self._plan.plan.leaves))))
        return None if bool(norm < self.max_grad_norm) else norm

    def _applied(self, update: LayerUpdate, scale: jax.Array | None, units: Sequence[Unit]) -> Iterator[list]:
        """Each unit's params after the deferred ``update``, in order: the next unit's params and grads are handed
        over before a unit's new params are given, so its update runs while the forward computes."""
        reads = self._reads.ahead(units, functools.partial(self._reads.params_and_grads, step=self._stream.step))

        def hand_over(unit: Unit) -> None:
            params, grads = next(reads)
            self._hand_over(update, unit, params, grads, scale)

        hand_over(units[0])
        for index, unit in enumerate(units):
            fresh = self._fresh(update, unit)
            if index + 1 < len(units):
                hand_over(units[index + 1])
            yield fresh

    def _backward(
        self,
        take: Callable[[Unit, list[jax.Array], list[jax.Array]], None],
        micro: Sequence[Any],
        kept: list[Sequence[Any] | None],
        head_grads: Sequence[Any],
        gys: Sequence[Any],
        turnaround: list[jax.Array] | None,
    ) -> dict[int, jax.Array]:
        """The backward in reverse, each unit's params and grads (the micro-batches' mean) given to ``take``.

        ``turnaround``, the last layer's params as the forward left them on the device, saves reading them
        again (the update takes them: a redo reads them). The params are read one unit ahead, as the update's
        state is: the writes, which bound the step, follow the state reads, which would queue behind params
        read further ahead.

        Returns:
          Each leaf's sum of squares of its grads (for the global norm), by leaf index.
        """
        plan = self._plan
        sums: dict[int, jax.Array] = {}
        layer_units = plan.units[:-1]
        order = [*layer_units[::-1], plan.outer]
        read = functools.partial(self._reads.params, step=self._stream.step)
        ahead = self._reads.ahead(order if turnaround is None else order[1:], read, 1)  # the state beside
        gys = list(gys)
        inputs = self._inputs.bring(kept[-1])

        def give(unit: Unit, params: list[jax.Array], grads: Sequence[Any]) -> None:
            mean = jax.tree_util.tree_leaves(grads[0] if len(grads) == 1 else micro_mean(grads))
            for leaf, value in zip(unit.leaves, squares(mean), strict=True):
                sums[leaf] = value
            take(unit, params, mean)

        for index in reversed(range(len(layer_units))):
            unit = layer_units[index]
            params_leaves, turnaround = (next(ahead), None) if turnaround is None else (turnaround, None)
            params = self._tree(unit, params_leaves)
            xs, inputs = kept_inputs.ready(inputs), self._inputs.bring(kept[index - 1]) if index else None
            grads, before = [], list(gys)
            for m, x in enumerate(xs):
                gys[m], gp = self._jitted.layer_backward(params, x, gys[m])
                grads.append(gp)
            jax.block_until_ready(before)  # the layer after this one is done: two layers' backward at most in flight
            if self.max_grad_norm is None or self._defers:  # no redo can need the layer's input again
                kept[index] = None
            give(unit, params_leaves, grads)
        outer_leaves = next(ahead)  # read again: the update donates what it is handed
        outer = self._tree(plan.outer, outer_leaves)
        embed_grads = [self._jitted.embed_backward(outer, b, gy) for b, gy in zip(micro, gys, strict=True)]
        give(
            plan.outer,
            outer_leaves,
            [jax.tree.map(jnp.add, h, e) for h, e in zip(head_grads, embed_grads, strict=True)],
        )
        return sums

    def _giver(self, update: LayerUpdate, scale: jax.Array | None) -> Callable:
        """Gives each unit's params and grads to ``update``, the grads scaled by ``scale`` (if not None)."""
        return lambda unit, params, grads: self._hand_over(update, unit, params, grads, scale)

    def _hand_over(
        self, update: LayerUpdate, unit: Unit, params: Sequence[jax.Array], grads: list[jax.Array], scale: Any
    ) -> None:
        """A unit's params and grads to the update, by block, once it has taken the previous unit's."""
        if scale is not None:
            grads = clipped(grads, scale, self.max_grad_norm)
        keys = self._keys(unit)
        grads, params = self._plan.sharding.block_map(grads, unit.leaves), self._blocks(unit, params)
        update.hand_over(keys, [grads[key] for key in keys], [params[key] for key in keys])

    def _storer(self) -> Callable:
        """Stores each unit's grads in its subgroups' grads records, for the update deferred to the next forward;
        the writes run on the writer threads, at most two units' grads waiting on the device."""
        plan, stream, step = self._plan, self._stream, self._stream.step + 1
        writing: list[concurrent.futures.Future] = []

        def write(unit: Unit, blocks: dict) -> None:
            for k in unit.subgroups:
                pieces = plan.plan.subgroups[k].pieces
                values = _pieces_of(pieces, [blocks[p.leaf, p.device] for p in pieces])
                stream.store_grads(k, [np.asarray(v) for v in values], step)

        def store(unit: Unit, _: Any, grads: list[jax.Array]) -> None:
            while len(writing) > 1:
                writing.pop(0).result()
            writing.append(self._writers.submit(write, unit, plan.sharding.block_map(grads, unit.leaves)))
            if unit is plan.outer:  # the last: every write done before the step returns
                for future in writing:
                    future.result()

        return store

    # ----------------------------------------------------------------------------- reading the params back

    def params(self) -> tuple[Any, Any]:
        """The outer params and the layers' params (stacked on axis 0) at the tiers' step, read from the tiers.

        For evaluation or a checkpoint of a model that fits in memory; a larger one is read unit by unit
        with :meth:`unit_params`.
        """
        plan = self._settled()
        outer = self.unit_params(plan.num_layers)
        layers = [self.unit_params(index) for index in range(plan.num_layers)]
        return outer, jax.tree.map(lambda *xs: jnp.stack(xs), *layers)

    def unit_params(self, index: int) -> Any:
        """The params of layer ``index`` (``num_layers``: the outer params) at the tiers' step."""
        plan = self._settled()
        unit = plan.units[index]
        return self._tree(unit, self._reads.params(unit, self._stream.step).result())

    # ----------------------------------------------------------------------------- lifecycle

    def _settled(self) -> LayerPlan:
        """The plan, once the last step's update (still writing, or deferred) has run and been committed."""
        plan = self._initialised()
        if self._writing is not None:
            self._end_writing(self._writing)
        pending, self._pending = self._pending, None
        if pending is not None:
            update = self._new_update(pending.uniform, fresh=self._keys(*plan.units))
            try:
                for _ in self._applied(update, pending.scale, [plan.outer, *plan.units[:-1]]):
                    pass  # no forward computes with the new params: each unit's go as they come
                update.commit()
            except BaseException:
                self._pending = pending
                update.abort("applying the deferred update failed")
                raise
        return plan

    def _release(self, *, delete: bool) -> None:
        """Stops the reads, closes the tiers (``delete``: removing their files) and removes the inputs' files."""
        try:
            if self._reads is not None:
                self._reads.close()
            if self._stream is not None:
                self._stream.close(delete=delete)
        finally:
            if self._inputs is not None:
                self._inputs.close()

    def _initialised(self) -> LayerPlan:
        if self._plan is None or self._stream is None:
            raise OffloadError("this stream_layers has not been initialised: call init first")
        self._check_open()
        return self._plan

    def _check_open(self) -> None:
        if self._closed:
            raise OffloadError("this stream_layers is closed; create a new one (with resume=True to continue)")

    def pin(self) -> Pin:
        """Flushes, then pins the tiers' step, so a reader beside training (a checkpoint save) finds its records."""
        self._settled()
        return self._stream.pin()

    def read_pinned(self, pin: Pin, record: int) -> Any:
        """Record ``record``'s fields at the pinned step (see :meth:`TierStack.read_pinned`), then unpinned."""
        self._initialised()
        return self._stream.tiers.read_pinned(pin, record)

    def flush(self) -> None:
        """Commits the last step's update (running a deferred one first) and writes every dirty cached record to
        storage, so the tiers alone hold the newest step."""
        self._check_open()
        if self._stream is not None:
            self._settled()
            self._stream.flush()

    def close(self, *, delete: bool = False) -> None:
        """Flushes (unless ``delete``), stops the threads and lets go of the paths; ``delete`` removes the files."""
        if self._closed:
            return
        try:
            if not delete:
                self.flush()
        finally:
            self._closed = True
            if self._writing is not None:  # deleted, or a flush that failed: nothing to commit
                self._writing.abort("closed")
                self._writing = None
            self._writers.shutdown(wait=True)
            self._release(delete=delete)


CLIPPINGS = ("speculate", "defer")
"""When the update of a step whose grads are clipped by their global norm runs: see :class:`LayerStream`."""


FRESH_UNITS = 2
"""The units a step's forward takes from the last step's update as it made them, not from their records: the
outer params and the first layer, the last the update makes and the first the forward needs, so the update's
writes run on into the forward."""


class _Pending(NamedTuple):
    """A deferred update: the global norm its stored grads are scaled by (None: not clipped), and its shared state."""

    scale: jax.Array | None
    uniform: Uniform


class _Stacked(NamedTuple):
    """Layers given as stacked params."""

    stacked: Any
    shapes: tuple[Any, int]

    def layer(self, index: int) -> Any:
        return jax.tree.map(lambda x: x[index], self.stacked)


class _Initialised:
    """Layers made one at a time by the user's ``layer_init``, each once: the first, made for its shapes, is kept
    until it is used."""

    def __init__(self, make: Callable[[int], Any], count: int):
        self._make = make
        self._first = make(0)
        self.shapes = (jax.tree.map(_shape_of, self._first), count)

    def layer(self, index: int) -> Any:
        if index == 0 and self._first is not None:
            first, self._first = self._first, None
            return first
        return self._make(index)


def _shape_of(x: Any) -> jax.ShapeDtypeStruct:
    """A layer's leaf as a shape, with its sharding where it spans several devices."""
    sharding = getattr(x, "sharding", None)
    spans = sharding is not None and len(sharding.device_set) > 1
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding if spans else None)


def _pieces_of(pieces: Sequence[Piece], blocks: Sequence[jax.Array]) -> list[jax.Array]:
    """Each piece's part of its leaf's block: the block, or its rows."""
    return [b if p.rows is None else b[p.rows[0] : p.rows[1]] for p, b in zip(pieces, blocks, strict=True)]


def _as_arrays(tree: Any) -> Any:
    return jax.tree.map(jnp.asarray, tree)
