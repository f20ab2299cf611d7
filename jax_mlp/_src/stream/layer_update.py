"""The update of a layer-streamed step: a transaction of the state stream on its own thread, fed as the backward
hands each layer over.

The backward files each unit's grads and params in an :class:`Inbox`; the transaction streams the
subgroups in the backward's order, each program waiting for its blocks; :class:`LayerResults` runs the
fused apply on them and gives each subgroup's new params for its params record. The backward hands a
unit over only once the update has taken the one before, so one unit's blocks wait on the device.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import jax

from jax_mlp._src.errors import OffloadError
from jax_mlp._src.plan.partition import Subgroup
from jax_mlp._src.plan.programs import Programs, SubgroupUpdate, Uniform
from jax_mlp._src.stream.blocks import Blocks, Staging
from jax_mlp._src.stream.state_stream import EAGER, StateStream, Transaction


class Inbox(Mapping):
    """Blocks handed to the update as the backward makes them, by key; a program waits for its own.

    Args:
      timeout: seconds a program waits for a block before the step fails (``io_timeout``).
      late: who failed to file a block in time, for the error.
    """

    def __init__(self, timeout: float, late: str = "the backward did not hand over"):
        self._blocks: dict[Any, jax.Array] = {}
        self._condition = threading.Condition()
        self._cancelled: str | None = None
        self._timeout = timeout
        self._late = late

    def file(self, blocks: Mapping[Any, jax.Array]) -> None:
        with self._condition:
            self._blocks.update(blocks)
            self._condition.notify_all()

    def cancel(self, reason: str) -> None:
        """Calls the update off: a program waiting for a block raises."""
        with self._condition:
            self._cancelled = reason
            self._condition.notify_all()

    def pop(self, key: Any, default: Any = None) -> Any:
        with self._condition:
            value = self._blocks.pop(key, default)
            self._condition.notify_all()
            return value

    def wait_until_taken(self) -> None:
        """Waits until every block filed so far has been taken.

        The backward files a unit's blocks only once the update has taken the previous unit's, so the
        device holds one unit's grads waiting, besides the unit the backward computes.

        Raises:
          OffloadError: the update was called off (it failed: naming why), or it took longer than the timeout.
        """
        with self._condition:
            if not self._condition.wait_for(lambda: not self._blocks or self._cancelled, self._timeout):
                raise OffloadError(f"the update did not take a layer's grads within io_timeout={self._timeout:g}s")
            if self._cancelled:
                raise OffloadError(f"the layer-streamed update was called off: {self._cancelled}")

    def __getitem__(self, key: Any) -> jax.Array:
        with self._condition:
            ready = self._condition.wait_for(lambda: key in self._blocks or self._cancelled, self._timeout)
            if self._cancelled:
                raise OffloadError(f"the layer-streamed update was called off: {self._cancelled}")
            if not ready:
                raise OffloadError(f"{self._late} param {key} within io_timeout={self._timeout:g}s")
            return self._blocks[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __len__(self) -> int:
        return 0


class LayerResults:
    """Each subgroup's fused apply on the params and grads the backward handed over: its new params go to its
    params record; a block's grads and params (a leaf's, or one device's shard of it) leave the device once its
    last subgroup has run.

    A row chunk's program writes its rows into its block's params, which the block's next chunk takes,
    so each block is updated in place as in ``apply``.
    """

    def __init__(self, plan: Any, inbox: Inbox, uses: Mapping[Any, int], fresh: Inbox, kept: Collection[Any]):
        self._plan, self._inbox, self._fresh, self._kept = plan, inbox, fresh, kept
        self._uses = dict(uses)
        self._blocks: dict[Any, jax.Array] = {}

    def compute(self, programs: Programs, subgroup: Subgroup, blocks: Blocks, fields: tuple) -> SubgroupUpdate:
        keys = [(p.leaf, p.device) for p in subgroup.pieces]
        params = [self._params_block(key) for key in keys]
        out = programs.apply(subgroup, blocks.args(subgroup, fields), params)
        pieces = []
        for piece, key, block in zip(subgroup.pieces, keys, out.outputs, strict=True):
            pieces.append(block if piece.rows is None else block[piece.rows[0] : piece.rows[1]])
            self._uses[key] -= 1
            if self._uses[key]:
                self._blocks[key] = block
            else:
                grads = self._inbox.pop(("grads", key))
                if grads is not None:
                    grads.delete()
                if key in self._kept:  # the block's new params, for the forward that waits on them
                    self._fresh.file({key: block})
        blocks.staging.done(subgroup)
        return out._replace(param_pieces=pieces)

    def _params_block(self, key: Any) -> jax.Array:
        """A leaf's params block: as its previous row chunk left it, else as the backward handed it over."""
        if key in self._blocks:
            return self._blocks.pop(key)
        block = self._inbox["params", key]
        self._inbox.pop(("params", key))
        return block

    def result(self) -> dict:
        return {}


class _GradsView(Mapping):
    """``Blocks.grads`` of the update: the inbox's grads by key."""

    def __init__(self, inbox: Inbox):
        self._inbox = inbox

    def __getitem__(self, key: Any) -> jax.Array:
        return self._inbox["grads", key]

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __len__(self) -> int:
        return 0


class LayerUpdate:
    """One step's update: a transaction of the state stream, streaming on its own thread as grads come in.

    ``redone``: it redoes a step whose clipping fired (its stats say so). The new params of the blocks ``fresh`` names are also kept for :meth:`take_fresh`, until taken: those the
    next forward computes with before their records are written (a deferred update's, every block; the
    first units of the next forward, where the writes run into it). :meth:`wait_stored` tells when a
    subgroup's records are written, so the next forward can read the others.
    """

    def __init__(
        self,
        stream: StateStream,
        plan: Any,
        uniform: Uniform,
        devices: Sequence[jax.Device],
        timeout: float,
        *,
        fresh: Collection[Any] = frozenset(),
        redone: bool = False,
    ):
        self.inbox = Inbox(timeout)
        self.fresh = Inbox(timeout, "the update did not make the new")
        uses = collections.Counter((p.leaf, p.device) for sg in plan.subgroups for p in sg.pieces)
        blocks = Blocks(
            _GradsView(self.inbox), None, list(devices), uniform, Staging(plan, ["device"] * len(plan.leaves))
        )
        self._stream = stream
        self._notes = {"rolled_back": redone}  # for the stats of its step
        self.transaction: Transaction = stream.begin(cache_state=False)
        self.outcome: Any = None
        self._done = threading.Event()
        self._stored: set[int] = set()
        self._progress = threading.Condition()
        self._timeout = timeout
        results = LayerResults(plan, self.inbox, uses, self.fresh, frozenset(fresh))

        def run() -> None:
            try:
                self.outcome = stream.stream_subgroups(self.transaction, blocks, EAGER, results, self._note_stored)
            except BaseException as error:
                self.outcome = error
                self.inbox.cancel(f"it failed: {error}")  # the backward handing over learns it at once
                self.fresh.cancel(f"it failed: {error}")
            finally:
                with self._progress:
                    self._done.set()
                    self._progress.notify_all()

        self._thread = threading.Thread(target=run, daemon=True, name="jax_mlp-layers-update")
        self._thread.start()

    def hand_over(self, keys: Sequence[Any], grads: Sequence[jax.Array], params: Sequence[jax.Array]) -> None:
        """Files a unit's grads and params blocks for the update, once it has taken the previous unit's."""
        self.inbox.wait_until_taken()
        blocks = {("grads", key): g for key, g in zip(keys, grads, strict=True)}
        blocks.update({("params", key): p for key, p in zip(keys, params, strict=True)})
        self.inbox.file(blocks)

    def take_fresh(self, keys: Sequence[Any]) -> dict[Any, jax.Array]:
        """The new params blocks of ``keys``, as the update makes them (waiting for each), no longer kept here."""
        taken = {key: self.fresh[key] for key in keys}
        for key in keys:
            self.fresh.pop(key)
        return taken

    def _note_stored(self, index: int) -> None:
        with self._progress:
            self._stored.add(index)
            self._progress.notify_all()

    def wait_stored(self, index: int) -> None:
        """Waits until subgroup ``index``'s records are written (its params readable at the update's new step).

        Raises:
          OffloadError: the update failed first (naming why), or the records took longer than ``io_timeout``.
        """
        with self._progress:
            self._progress.wait_for(lambda: index in self._stored or self._done.is_set(), self._timeout)
            if index in self._stored:
                return
        if isinstance(self.outcome, BaseException):
            raise OffloadError(
                f"the update writing subgroup {index}'s records failed: {self.outcome}"
            ) from self.outcome
        raise OffloadError(f"subgroup {index}'s records were not written within io_timeout={self._timeout:g}s")

    def commit(self) -> None:
        """Waits for the stream and commits its step; raises what it raised (the transaction is then still to be
        aborted)."""
        self._done.wait()
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        _, timings, compiles = self.outcome
        self._stream.end(self.transaction, timings, compiles, self._notes)

    def abort(self, reason: str) -> None:
        """Calls the update off and undoes its transaction: the tiers keep the step they held."""
        self.inbox.cancel(reason)
        self.fresh.cancel(reason)
        self._done.wait()
        self._stream.abort(self.transaction)
