"""The in-jit route: ``update`` traced inside ``jax.jit`` becomes one host callback per device.

Inside jit the state cannot stream through the devices. Instead each device hands its blocks of the
grads (and params) to the host through ``io_callback``, inside ``shard_map`` over the params' mesh
with their ``PartitionSpec``s. The callbacks meet at a :class:`Rendezvous`: the last to arrive runs
the update of every owned block on the host CPU backend, as ZeRO-Offload's CPU Adam does, and each
callback returns its device's block of the updates. A replica returns its owner's block, so no state
is stored or updated twice, and no device ever holds more than its own block.

Where the callbacks run is the params' :class:`~jax_mlp._src.plan.callback_layout.CallbackLayout`;
a layout that cannot serve is refused only when the route is taken, since most users never trace
``update``. Accumulation is refused here: its choice would be a ``lax.cond`` around the host
callback, and that was seen to deadlock XLA's CPU runtime now and then (the callback's device work
waiting behind the caller's next step). The update runs after the backward, in the same program,
so the next backward starts none.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import io_callback
from jax.sharding import PartitionSpec as P

from jax_mlp._src.errors import OffloadError
from jax_mlp._src.offload import window
from jax_mlp._src.offload.route import Call, Outcome, Parts
from jax_mlp._src.plan.callback_layout import CallbackLayout, device_index
from jax_mlp._src.plan.programs import Uniform, update_dtype
from jax_mlp._src.plan.sharding import DEVICE_MEMORY, BlockKey
from jax_mlp._src.state import OffloadState
from jax_mlp._src.stream.blocks import Blocks, Staging
from jax_mlp._src.stream.state_stream import IN_CALLBACK

logger = logging.getLogger(__name__)


def host_update(
    layout: CallbackLayout,
    on_device: Callable[..., list[np.ndarray]],
    grads: Sequence[jax.Array],
    params: Sequence[jax.Array] | None,
    step: jax.Array,
    uniform: Uniform,
    out_blocks: Sequence[jax.ShapeDtypeStruct],
) -> list[jax.Array]:
    """Traces the update as one ``on_device(step, device_index, uniform, *grad_blocks, *param_blocks)`` per device.

    Args:
      layout: from :func:`~jax_mlp._src.plan.callback_layout.callback_layout`.
      on_device: runs on the host, once per device of the mesh, with that device's flat index in
        the mesh and its blocks; returns the device's block of each leaf's update.
      grads: the gradient leaves (tracers).
      params: the param leaves, or None.
      step: the traced step of the ``OffloadState``.
      uniform: what every subgroup is given alike (tracers), replicated to every device.
      out_blocks: per leaf, the shape and dtype of one device's block of its update.

    Returns:
      The update leaves, sharded as the params.
    """
    mesh, specs = layout.mesh, list(layout.specs)
    params = list(params or [])

    def per_device(step, uniform, grads, params):
        return io_callback(on_device, list(out_blocks), step, device_index(mesh), uniform, *grads, *params)

    mapped = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(), P(), specs, specs if params else []),
        out_specs=specs,
        check_vma=False,
    )
    return mapped(step, uniform, list(grads), params)


class Rendezvous:
    """Where the callbacks of one step meet: the last to arrive runs the step for all of them.

    Args:
      parties: the callbacks per step (the mesh's devices).
      timeout: seconds a callback waits for the others and for the step before it raises
        (``peer_timeout``).
    """

    def __init__(self, parties: int, timeout: float):
        self._parties = parties
        self._timeout = timeout
        self._condition = threading.Condition()
        self._arrived: dict[int, dict[int, Any]] = {}
        self._outcomes: dict[int, tuple[Any, BaseException | None, set[int]]] = {}

    def meet(self, key: int, party: int, payload: Any, work: Callable[[dict[int, Any]], Any]) -> Any:
        """Leaves ``payload``; the last party calls ``work`` with every payload. Returns ``work``'s result.

        Raises:
          OffloadError: the other parties or the step did not come within the timeout.
          BaseException: whatever ``work`` raised, in every party.
        """
        with self._condition:
            arrived = self._arrived.setdefault(key, {})
            arrived[party] = payload
            last = len(arrived) == self._parties
            if last:
                del self._arrived[key]
        if last:
            try:
                outcome = (work(arrived), None)
            except BaseException as error:
                outcome = (None, error)
            with self._condition:
                self._outcomes[key] = (*outcome, set(arrived))
                self._condition.notify_all()
        with self._condition:
            if not self._condition.wait_for(lambda: key in self._outcomes, self._timeout):
                waiting_for = self._arrived.pop(key, None)  # None: all arrived, the update is running
                what = "the update did not finish"
                if waiting_for is not None:
                    what = f"{self._parties - len(waiting_for)} of {self._parties} devices' callbacks did not arrive"
                raise OffloadError(
                    f"in-jit update at step {key}: {what} within peer_timeout={self._timeout} s; the step is "
                    "intact on storage"
                )
            result, error, waiting = self._outcomes[key]
            waiting.discard(party)
            if not waiting:
                del self._outcomes[key]
        if error is not None:
            raise error
        return result


class JitRoute:
    """The in-jit route of one offloader: :meth:`run` is what ``update`` becomes when traced.

    Args:
      parts: what the offload's routes are built from; its stream runs each step's update on the host CPU device.
      layout: where the params live for host callbacks, or None where they cannot be mapped.
      unusable: why there is no layout.
    """

    def __init__(self, parts: Parts, layout: CallbackLayout | None, unusable: str | None):
        self._parts = parts
        self._plan, self._stream = parts.plan, parts.stream
        self.layout, self._unusable = layout, unusable
        self._failure: str | None = None
        self._announced = False
        if layout is not None:
            devices = layout.mesh.local_devices
            self._keys = parts.sharding.block_keys(parts.plan, devices)
            self._rendezvous = Rendezvous(len(devices), parts.config.peer_timeout)

    def run(self, call: Call) -> Outcome:
        """Traces one update as a host callback per device: the update leaves, sharded as the params.

        Raises:
          OffloadError: the params' layout cannot run inside jit, or the offload accumulates; the message
            says what to change.
        """
        window.refuse_multisteps()
        accumulate_steps = self._parts.config.accumulate_steps
        if accumulate_steps > 1:
            raise OffloadError(
                f"mlp_offload with accumulate_steps={accumulate_steps} was called inside jax.jit; "
                "accumulation runs eagerly: call tx.update (or nnx.Optimizer.update) outside jit, with the jitted "
                "loss and gradients before it, or accumulate in your jitted step and create the mlp_offload "
                "without accumulate_steps"
            )
        if self.layout is None:
            raise OffloadError(self._unusable)
        uniform, new_shared = self._parts.calls.uniform(call)
        state = call.state
        leaves = self._trace(call.grads, call.params, state.step, uniform)
        return Outcome(leaves, call.grads_tree, OffloadState(state.step + 1, new_shared), None)

    def _trace(
        self, grads: Sequence[jax.Array], params: Sequence[jax.Array] | None, step: jax.Array, uniform: Uniform
    ) -> list:
        self._announce()
        shapes = self.layout.block_shapes([spec.shape for spec in self._plan.leaves])
        out_blocks = [jax.ShapeDtypeStruct(shape, update_dtype(self._plan, i)) for i, shape in enumerate(shapes)]
        return host_update(self.layout, self._on_device, grads, params, step, uniform, out_blocks)

    def _announce(self) -> None:
        """Says once, on the ``jax_mlp`` logger, where a traced update runs and what the split step gains.

        WARNING when the params live on an accelerator: there the split step keeps the update on the
        device, while this route moves every step's grads, params and updates through the host and
        runs the update on its CPU. INFO on CPU, where both routes run the update on the same CPU and
        this one only adds the copies (1.25-2.9x the split step's time in ``benchmarks/routes.py``).
        """
        if self._announced:
            return
        self._announced = True
        platform = self.layout.mesh.devices.flat[0].platform
        logger.log(
            logging.INFO if platform == "cpu" else logging.WARNING,
            "mlp_offload: update was traced inside jit, so it runs on the host CPU (the params are on %s): each "
            "step copies the grads, params and updates between the devices and the host and runs the whole update "
            "on the CPU, and the first step compiles the update for the CPU. The split step is faster, most of all "
            "on an accelerator: jit the loss and gradients, and call tx.update (nnx.Optimizer.update, "
            "TrainState.apply_gradients) outside jit, where the update runs on the params' device. See "
            "docs/usage.md, 'Which route runs where'",
            platform,
        )

    def _on_device(
        self, step: np.ndarray, device_index: np.ndarray, uniform: Uniform, *blocks: np.ndarray
    ) -> list[np.ndarray]:
        """One device's host callback: meets the others, then returns its blocks of the updates."""
        device = self.layout.mesh.devices.flat[int(device_index)]
        on_host = functools.partial(self._on_host, int(step), uniform)  # every device brings the same uniform
        results = self._rendezvous.meet(int(step), device.id, blocks, on_host)
        return [results[key] for key in self._keys[device.id]]

    def _on_host(
        self, step: int, uniform: Uniform, blocks_by_device: dict[int, Sequence[np.ndarray]]
    ) -> dict[BlockKey, np.ndarray]:
        """The whole update on the host CPU backend, with every device's grad (and param) blocks.

        Runs in the callback of the last device to arrive. An error leaves step ``step`` intact and
        this route refusing further updates (the jitted caller cannot roll back with it): close the
        offloader and reopen it with ``resume=True``.

        Returns:
          Each owned block's update as a numpy array, by (leaf, owner device id).
        """
        if self._failure is not None:
            raise OffloadError(
                f"an earlier in-jit update of this mlp_offload failed ({self._failure}); its step is intact "
                "on storage: close this mlp_offload and create it again with resume=True"
            )
        try:
            self._parts.overlap.settle()
            blocks = self._blocks_on(self.layout.host, blocks_by_device, uniform)
            with jax.default_device(self.layout.host):
                results = self._stream.advance(step, blocks, IN_CALLBACK)
        except BaseException as error:
            self._failure = f"{type(error).__name__}: {error}"
            raise
        return {key: np.asarray(value) for key, value in results.items()}  # this thread waits: see step.IN_CALLBACK

    def _blocks_on(
        self, host: jax.Device, blocks_by_device: dict[int, Sequence[np.ndarray]], uniform: Uniform
    ) -> Blocks:
        """Every device's owned grad (and param) blocks, put on the host CPU device, where every subgroup runs."""
        plan = self._plan
        n = len(plan.leaves)
        whole = next(iter(blocks_by_device))  # the device of leaves on one device (a one-device mesh)
        keys = {(p.leaf, p.device) for subgroup in plan.subgroups for p in subgroup.pieces}

        def put(offset: int) -> dict[BlockKey, jax.Array]:
            on_device = {key: blocks_by_device[whole if key[1] is None else key[1]] for key in keys}
            return {key: jax.device_put(values[offset + key[0]], host) for key, values in on_device.items()}

        params = put(n) if len(blocks_by_device[whole]) > n else None
        staging = Staging(plan, [DEVICE_MEMORY] * n)  # the callbacks' arrays, all put on the host CPU device
        return Blocks(put(0), params, [host] * len(plan.subgroups), uniform, staging)

    def settle(self) -> None:
        """Waits for the jitted updates still queued on the devices, so none meets closed tiers.

        A failed one has raised in its own results already; here it only must not stop the close.
        """
        if self.layout is None:
            return
        try:
            jax.effects_barrier()
        except Exception:
            logger.debug("a jitted update failed before close; its results carry the error", exc_info=True)
