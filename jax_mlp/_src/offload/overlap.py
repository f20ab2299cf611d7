"""The update started inside the backward pass, from the grads it hands over as it makes them.

``offload.overlap(params)``, applied to the params inside the loss, is the identity in the forward.
In the backward, an ``io_callback`` hands each leaf's gradient to the host the moment it is
computed (one per device for a sharded leaf, inside ``shard_map``), with the leaf's params when the
inner optimizer reads them. The callback only files the arrays. The first one of a step starts an
update on a thread of its own: a transaction whose reads run ahead at once and whose subgroups each
run as soon as their grads are in, in the order the backward hands them over (last layer first,
learnt from the step before). Its new records go to the slot the tiers' step does not hold: nothing
is committed yet. Only the grads of the subgroups about to run are kept (``prefetch_depth + 1`` of
them): later ones take the final grads ``update`` is given, so host memory stays bounded. With
``overlap_mode="timed"`` a step starts one only while overlapped steps time faster than split ones
(``schedule/overlap_choice.py``); otherwise its backward's grads are let go.

``update`` (or the last call of an accumulation window) finishes the step with the final grads:
subgroups still to run take them; those that ran from handed-over grads are checked against them
by a 64-bit fingerprint of their bits (:func:`fingerprint`, integer arithmetic on the device). All
equal, the transaction commits and the step is bitwise what the split route gives. Any difference (a
clipping that fired, a NaN guard, other params or shared state) aborts it, as a failed update is
aborted, and the step streams again from the committed slot with the final grads: a rollback.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import io_callback

from jax_mlp._src.config import OffloadConfig
from jax_mlp._src.errors import OffloadError
from jax_mlp._src.offload import window as accumulation_window
from jax_mlp._src.plan.callback_layout import CallbackLayout, device_index
from jax_mlp._src.plan.partition import Plan
from jax_mlp._src.plan.programs import Uniform
from jax_mlp._src.plan.sharding import DEVICE_MEMORY, BlockKey, LeafSharding, in_memory
from jax_mlp._src.schedule.overlap_choice import RETRY_EVERY, TRIAL_STEPS, OverlapChoice
from jax_mlp._src.stream.arrivals import Arrivals, Cancelled, FollowedUpdates, Mailbox, fingerprint
from jax_mlp._src.stream.blocks import Blocks, Staging
from jax_mlp._src.stream.engine import Timings
from jax_mlp._src.stream.state_stream import EAGER, StateStream, Transaction

logger = logging.getLogger(__name__)


class Basis(NamedTuple):
    """What an overlapped update assumes besides the grads, checked against ``update``'s call.

    Attributes:
      step: the step the tiers hold.
      devices: each subgroup's device, as the last call placed them.
      uniform: the shared state (the last one ``update`` returned) and its successor; no extra args.
      window: the accumulation window the last micro-batch's grads are folded into (its count, and its
        running mean's blocks by key), or None.
    """

    step: int
    devices: tuple[jax.Device | None, ...]
    uniform: Uniform
    window: tuple[jax.Array, Mapping[BlockKey, jax.Array]] | None


class _Round:
    """One step's overlapped update: what it assumes, its arrivals, and the transaction its thread streams."""

    def __init__(self, basis: Basis, arrivals: Arrivals):
        self.basis = basis
        self.arrivals = arrivals
        self.streaming: float | None = None  # when its transaction began streaming
        self.transaction: Transaction | None = None
        self.outcome: tuple[dict[BlockKey, Any], Timings, int] | BaseException | None = None
        self.done = threading.Event()


class Overlap:
    """The backward's grads handed to the offloader as they are made, and the update they start.

    Args:
      config: the offload's options.
      plan: the subgroups.
      sharding: each leaf's sharding and owned shards, as at ``init``.
      stream: the offloaded state; an overlapped update is a transaction of it.
      layout: where the params live for host callbacks, or None where they cannot be mapped.
      unusable: why there is no layout.
      needs_params: whether the update reads the params (the inner optimizer does, or a master is kept).
    """

    def __init__(
        self,
        config: OffloadConfig,
        plan: Plan,
        sharding: LeafSharding,
        stream: StateStream,
        layout: CallbackLayout | None,
        unusable: str | None,
        needs_params: bool,
    ):
        self._config, self._plan, self._sharding, self._stream = config, plan, sharding, stream
        self._layout, self._unusable = layout, unusable
        self.needs_params = needs_params
        self.timeout = config.io_timeout
        self._lock = threading.Lock()
        self._round: _Round | None = None
        self._basis: Basis | None = None  # what the next step's update may assume; None: no overlap
        self._owed: set[tuple[str, BlockKey]] = set()  # blocks a finished step's backward has still to hand over
        self._pending: dict[str, dict[str, Any]] = {}  # the notes of a round undone before update came
        self._kinds = ("grads", "params") if needs_params else ("grads",)
        self._used = False  # whether a loss has applied the overlap yet
        self._keys_of = [[(p.leaf, p.device) for p in sg.pieces] for sg in plan.subgroups]
        self._subgroup_of = {key: index for index, keys in enumerate(self._keys_of) for key in keys}
        self._owners = sharding.owners(plan)
        self._identity = self._make_identity()
        self._choice = OverlapChoice()  # whether the next backward starts the update: the faster mode, as timed
        self._learnt: list[int] | None = None  # the order the last overlapped update's subgroups came in
        self._clock = time.perf_counter

    # ----------------------------------------------------------------------------- in the user's step

    @property
    def usable(self) -> bool:
        """Whether a loss may apply the overlap: :meth:`__call__` refuses it otherwise."""
        return self._layout is not None and not self._config.extra_args and self._config.flush == "idle"

    def __call__(self, params: Any) -> Any:
        """The identity on ``params`` whose backward hands each leaf's grads to this offloader (traceable)."""
        if self._layout is None:
            raise OffloadError(f"offload.overlap cannot hand the grads over: {self._unusable}")
        if self._config.extra_args:
            raise OffloadError(
                "offload.overlap starts the update before update is called, but this inner optimizer takes extra "
                f"arguments {[name for name, _ in self._config.extra_args]} that only update brings: drop "
                "offload.overlap from the loss"
            )
        if self._config.flush != "idle":
            raise OffloadError(
                "offload.overlap needs flush='idle': an overlapped update that the final grads do not match is "
                "undone from the step on storage, which flush='lazy' does not keep; create the mlp_offload "
                "without flush='lazy'"
            )
        leaves = jax.tree_util.tree_leaves(params)
        if len(leaves) != len(self._plan.leaves) or any(
            tuple(x.shape) != spec.shape for x, spec in zip(leaves, self._plan.leaves, strict=True)
        ):
            raise OffloadError(
                "offload.overlap was given another tree than the params given to init: apply it to the whole param "
                "tree, as init saw it, inside the loss"
            )
        self._used = True
        return self._identity(params)

    def _make_identity(self) -> Callable[[Any], Any]:
        @jax.custom_vjp
        def identity(params: Any) -> Any:
            return params

        def forward(params: Any) -> tuple[Any, Any]:
            return params, (params if self.needs_params else None)

        def backward(saved: Any, grads: Any) -> tuple[Any]:
            grad_leaves = jax.tree_util.tree_leaves(grads)
            param_leaves = jax.tree_util.tree_leaves(saved) if saved is not None else [None] * len(grad_leaves)
            for leaf, (grad, param) in enumerate(zip(grad_leaves, param_leaves, strict=True)):
                self._hand_over(leaf, grad, param)
            return (grads,)

        identity.defvjp(forward, backward)
        return identity

    def _hand_over(self, leaf: int, grad: jax.Array, param: jax.Array | None) -> None:
        """Traces the callback(s) that hand ``leaf``'s grad (and param) to the host: one per device of its mesh."""
        arrays = (grad,) if param is None else (grad, param)
        arrive = functools.partial(self._arrive, leaf)
        mesh = self._layout.mesh
        if mesh.size == 1:
            io_callback(arrive, None, np.int32(0), *arrays, ordered=False)
            return
        spec = self._layout.specs[leaf]

        def per_device(*blocks: jax.Array) -> tuple:
            io_callback(arrive, None, device_index(mesh), *blocks, ordered=False)
            return ()

        jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * len(arrays), out_specs=(), check_vma=False)(*arrays)

    def _arrive(self, leaf: int, index: np.ndarray, grad: jax.Array, param: jax.Array | None = None) -> None:
        """An ``io_callback``: files one leaf's block and returns at once (it holds up the device's program).

        It reads nothing of the arrays it is given (on fake CPU devices that can wait for the very
        threads the devices hold): the program that takes them does.
        """
        device = self._layout.mesh.devices.flat[int(index)]
        owners = self._owners[leaf]
        if owners is not None and owners[device] != device.id:
            return  # a replica: its owner hands the block over
        key = (leaf, None if owners is None else device.id)
        round_ = self._round_for_arrival(key)
        if round_ is None:
            return
        arrivals = round_.arrivals
        duplicate = not arrivals.file("grads", key, grad)
        if param is not None:
            duplicate |= not arrivals.file("params", key, param)
        if duplicate:
            arrivals.cancel("a leaf's grads were handed over twice in one step (a second backward)")

    def _round_for_arrival(self, key: BlockKey) -> _Round | None:
        """The step's round, started by its first arrival; None when the next update does not take one.

        An arrival the last step's backward still owed (its callbacks can come after its grads are
        returned, and even after its update) belongs to that step: it is let go.
        """
        with self._lock:
            owed = {(kind, key) for kind in self._kinds} & self._owed
            if owed:
                self._owed -= owed
                return None
            if self._round is not None:
                return self._round
            if self._basis is None:
                return None
            if not self._stream.scheduler.following:  # last layers first, or as the last overlapped step learnt
                self._stream.scheduler.follow(self._learnt or range(len(self._plan.subgroups) - 1, -1, -1))
            order = self._stream.scheduler.order(self._basis.step)
            arrivals = Arrivals(order, self._keys_of, self._config.prefetch_depth + 1)
            self._round = round_ = _Round(self._basis, arrivals)
            threading.Thread(target=self._speculate, args=(round_,), daemon=True, name="jax_mlp-overlap").start()
            return round_

    def _speculate(self, round_: _Round) -> None:
        """The overlapped update's own thread: a transaction streaming each subgroup as its grads come in."""
        try:
            round_.transaction = self._stream.begin()
            transfer = self._stream.transfer
            basis = round_.basis

            def put(value: Any, key: BlockKey) -> jax.Array:
                device = basis.devices[self._subgroup_of[key]]
                if device is None:  # uncommitted, as the grads the split route takes
                    return jax.device_put(np.asarray(value))
                return transfer.to_device(value, device)

            def put_grads(value: Any, key: BlockKey) -> jax.Array:
                block = put(value, key)
                if basis.window is None:
                    return block
                count, means = basis.window
                window = accumulation_window.Window(count, [means[key]])
                return accumulation_window.add([block], window, self._config.accumulator_dtype)[0][0]

            arrivals = round_.arrivals
            grads = Mailbox(arrivals, "grads", put_grads, self.timeout)
            params = Mailbox(arrivals, "params", put, self.timeout) if self.needs_params else None
            blocks = Blocks(grads, params, basis.devices, basis.uniform, Staging(self._plan, self._sharding.kinds))
            results = FollowedUpdates(self._plan, arrivals)
            round_.streaming = time.perf_counter()
            round_.outcome = self._stream.stream_subgroups(round_.transaction, blocks, EAGER, results, run_on=True)
        except BaseException as error:
            round_.outcome = error
        finally:
            round_.done.set()

    # ----------------------------------------------------------------------------- finishing the step

    def expect(self, basis: Basis | None, grads: Sequence[jax.Array] = ()) -> None:
        """What the next step's overlapped update may assume; None: the next backward starts none.

        ``grads`` are those of the call that says so: dispatch is asynchronous, so the backward that made
        them may not have handed them over yet. Once a loss has used the overlap, it is waited for, so
        that none of its callbacks is taken for the next step's.
        """
        if basis is not None and self._used:
            jax.block_until_ready(list(grads))
            if self._config.overlap_mode == "timed":
                basis = self._timed(basis)
        with self._lock:
            self._basis = basis

    def interrupted(self) -> None:
        """The offloader was used between steps (a flush, a save, a failed call): the step running is not timed."""
        self._choice.interrupted()

    def _timed(self, basis: Basis) -> Basis | None:
        """The step ended: ``basis`` if the next one overlaps, None if it runs split (its grads let go, its
        subgroups in the split route's order); logs what a trial of both modes found when one just ended."""
        choice = self._choice
        overlaps = choice.step_ended(self._clock())
        if choice.decided:
            self._log_trial()
        if overlaps:
            return basis
        self._stream.scheduler.follow(None)  # a split step takes the split route's order, and its cache
        return None

    def _log_trial(self) -> None:
        choice = self._choice
        found = (
            f"overlapped steps took {choice.last.overlapped_step_s:.3f} s, split ones {choice.last.split_step_s:.3f} s "
            f"(medians of {TRIAL_STEPS})"
        )
        if choice.last.overlap_fallback:
            logger.warning(
                "mlp_offload: %s: the next %d steps run split (the backward's grads are let go), then both are "
                "timed again; the bits are the same either way",
                found,
                RETRY_EVERY,
            )
        else:
            logger.info("mlp_offload: %s: the overlap stays on", found)

    def basis(
        self, grads: Sequence[Any], shared: Any, window: accumulation_window.Window | None = None
    ) -> Basis | None:
        """What an update the next backward starts may assume: the tiers' step, the subgroups' devices (as
        ``grads`` are placed), the handle's ``shared`` state and, accumulating, the ``window`` its grads complete.

        None where no overlap can run (see :attr:`usable`), or from shapes alone (a resume or restore onto
        ``jax.ShapeDtypeStruct`` s): the next step then runs split.
        """
        if not self.usable or not all(isinstance(x, jax.Array) for x in grads):
            return None
        successor = self._stream.programs.shared_update(shared, {})
        leaves = jax.tree_util.tree_leaves
        uniform = Uniform(tuple(leaves(shared)), tuple(leaves(successor)), {})
        kept = None if window is None else (window.mini_step, self._sharding.block_map(window.acc_grads))
        devices = tuple(self._sharding.devices(self._plan, grads))
        return Basis(self._stream.step, devices, uniform, kept)

    def finish(self, blocks: Blocks) -> tuple[dict[BlockKey, Any] | None, dict[str, Any]]:
        """Finishes the step's overlapped update with the final ``blocks``, if one was started.

        Returns:
          Its results, committed, if everything it took from the backward matches ``blocks`` (None if
          there was none, or if it was rolled back: then the caller streams the step itself), and the
          notes its stats carry.
        """
        round_ = self._round_of_this_step(blocks)
        chosen = self._choice.last._asdict()
        if round_ is None:
            return None, {**self._pending.pop("undone", {}), **chosen}
        arrivals = round_.arrivals
        called = time.perf_counter()
        notes = {"overlap_s": 0.0 if round_.streaming is None else called - round_.streaming, **chosen}
        arrivals.finalise(blocks)
        reason = self._differs(round_, blocks)
        if reason is None:
            round_.done.wait()  # each of its waits is bounded (io_timeout)
            if isinstance(round_.outcome, BaseException):
                reason = f"it failed ({round_.outcome!r})"
        if reason is not None:
            self._abort(round_, reason)
            return None, {**self._pending.pop("undone"), **notes}
        results, timings, compiles = round_.outcome
        notes.update(overlapped=len(arrivals.early), overlap_bytes=arrivals.peak_bytes)
        self._close(round_)
        self._stream.end(round_.transaction, timings, compiles, notes)
        self._learnt = arrivals.completed + [k for k in arrivals.order if k not in arrivals.completed]
        self._stream.scheduler.follow(self._learnt)  # the next step takes them in the order they came
        return results, notes

    def _round_of_this_step(self, blocks: Blocks) -> _Round | None:
        """The round the backward of ``blocks``' grads started, if any; after it no round starts until
        :meth:`expect` says what the next one assumes.

        Dispatch is asynchronous: ``update`` may be called before the backward has run, or even begun.
        When a round could still start, it waits for the grads: by then every callback of their program
        has been made. No round can start before a loss has applied the overlap: then nothing is waited for.
        """
        with self._lock:
            round_, armed = self._round, self._basis is not None and self._used
        if round_ is None and armed:
            jax.block_until_ready([blocks.grads[key] for keys in self._keys_of for key in keys])
        with self._lock:
            round_, self._basis = self._round, None
        return round_

    def settle(self) -> None:
        """Undoes the step's overlapped update, if one is running, before another use of the stream (``flush``, a
        save, a call within an accumulation window, the in-jit route, ``close``); the next update's stats say so."""
        with self._lock:
            round_ = self._round
        if round_ is not None:
            self._abort(round_, "the offloader was used before update")

    def abandon(self, reason: str) -> dict[str, Any]:
        """Rolls back the step's overlapped update, if one was started (``apply``, ``close``); its stats' notes."""
        with self._lock:
            round_, self._basis = self._round, None
        if round_ is None:
            return self._pending.pop("undone", {})
        logger.warning("mlp_offload: the update the backward started was undone: %s; use update with overlap", reason)
        self._abort(round_, reason)
        return self._pending.pop("undone")

    def _differs(self, round_: _Round, blocks: Blocks) -> str | None:
        """What the overlapped update assumed that ``blocks`` contradict, or None."""
        basis = round_.basis
        if tuple(blocks.devices) != basis.devices:
            return "the grads are placed on other devices"
        if blocks.uniform.extra_args:
            return "update was given extra arguments"
        uniform = [*blocks.uniform.shared, *blocks.uniform.new_shared]
        expected = [*basis.uniform.shared, *basis.uniform.new_shared]
        if any(_bits(a) != _bits(b) for a, b in zip(uniform, expected, strict=True)):
            return "the opt_state's shared state differs from the one the last update returned"
        if self.needs_params and blocks.params is None:
            return "update was not given the params"
        try:
            taken = round_.arrivals.taken(self.timeout)
        except Cancelled as error:
            return str(error)
        finals = {  # all dispatched before the first is waited for; each as the early program was given it
            (kind, key): fingerprint(in_memory(getattr(blocks, kind)[key], DEVICE_MEMORY))
            for (kind, key), handed_over in taken.items()
            if handed_over is not None
        }
        for (kind, key), handed_over in taken.items():
            if handed_over is None or _bits(finals[kind, key]) != _bits(handed_over):
                return (
                    f"the {kind} of param {self._plan.leaves[key[0]].path} differ from those the backward handed over"
                )
        return None

    def _abort(self, round_: _Round, reason: str) -> None:
        """Calls the round off, waits for its thread, and undoes its transaction: the step is as before it."""
        round_.arrivals.cancel(reason)
        round_.done.wait()
        if round_.transaction is not None:
            self._stream.abort(round_.transaction)
        self._close(round_)
        self._pending["undone"] = {"rolled_back": True, "overlap_bytes": round_.arrivals.peak_bytes}

    def _close(self, round_: _Round) -> None:
        """The round is over (its transaction to be ended, or undone): the stream is free, and what its backward
        still owes is let go when it comes."""
        with self._lock:
            self._owed = round_.arrivals.owed(self._kinds)
            self._round = None


def _bits(x: Any) -> bytes:
    """The bytes of ``x`` on the host, for an exact comparison."""
    return np.asarray(x).tobytes()
