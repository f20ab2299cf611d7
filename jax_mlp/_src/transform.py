"""The optax face: ``mlp_offload`` and the one handle users hold, ``OffloadTransformation``.

Options in, an ``optax.GradientTransformationExtraArgs`` out: its ``init`` and ``update`` are those
of a private :class:`~jax_mlp._src.offload.offloader.Offloader`, and its other verbs (``apply``,
``overlap``, ``flush``, ``close``, ``stats``, the read-only views, what checkpoints use) call it. The
user holds only :class:`~jax_mlp.OffloadState`, a step counter and the shared state; the tiers
hold the inner optimizer's state.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any, Unpack

import numpy as np
import optax

from jax_mlp._src.config import OffloadConfig, OffloadOptions
from jax_mlp._src.offload.masters import params_from_masters
from jax_mlp._src.offload.offloader import ClosesOnExit, Offloader
from jax_mlp._src.plan.partition import Plan
from jax_mlp._src.state import OffloadState
from jax_mlp._src.stats import UpdateStats, stats_callback
from jax_mlp._src.storage.tier_stack import Pin

__all__ = ["OffloadTransformation", "mlp_offload", "offloader_of", "restore_params"]


class OffloadTransformation(optax.GradientTransformationExtraArgs, ClosesOnExit):
    """What :func:`mlp_offload` returns: an optax transformation, and the handle on everything its offload does.

    ``init(params)`` and ``update(updates, opt_state, params=None, **extra_args)`` are optax's (see
    docs/api.md); the other methods and properties are below. A context manager: ``with
    mlp_offload(...) as offload:`` calls :meth:`close` on exit, also on an exception.
    """

    __slots__ = ()

    @property
    def _offloader(self) -> Offloader:
        return self.init.__self__

    # ----------------------------------------------------------------------------- the step

    def apply(self, grads: Any, opt_state: OffloadState, params: Any, **extra_args: Any) -> tuple[Any, OffloadState]:
        """The fused ``update`` plus ``optax.apply_updates``: the new params, written over the donated old ones.

        Each subgroup's program writes its new param blocks into the donated param buffers, and each
        gradient leaf is freed after its last subgroup: beside params and grads the device holds about
        one subgroup's state and the writes in flight. With ``master_dtype`` the result is bitwise
        ``update`` plus ``apply_updates``; without, within the core tolerance. ``grads`` and ``params``
        are consumed: use the returned params.

        Args:
          grads: the gradients (after any global transformation, e.g. clipping, applied by the caller).
          opt_state: the :class:`OffloadState` of the previous ``init``, ``update`` or ``apply``.
          params: the params; each leaf its own array, not one of the grads.
          **extra_args: arrays for the inner optimizer's ``update``, as for ``update``.

        Returns:
          The new params (with the params' shardings) and the new :class:`OffloadState`.

        Raises:
          OffloadError: inside ``jax.jit``, without params, with ``accumulate_steps``, or an array given twice.
        """
        return self._offloader.apply(grads, opt_state, params, **extra_args)

    def apply_to(self, model: Any, grads: Any, opt_state: OffloadState, **extra_args: Any) -> OffloadState:
        """The fused :meth:`apply` on a flax NNX model: its ``nnx.Param`` values are replaced in place.

        Args:
          model: the ``nnx.Module`` whose ``nnx.Param`` state was given to ``init``.
          grads: the gradients of those params (e.g. from ``nnx.grad``), after any global clipping.
          opt_state: the :class:`OffloadState` of the previous step.
          **extra_args: as for ``update``.

        Returns:
          The new :class:`OffloadState`.
        """
        from flax import nnx  # flax is an optional dependency

        params, opt_state = self.apply(grads, opt_state, nnx.state(model, nnx.Param), **extra_args)
        nnx.update(model, params)
        return opt_state

    def overlap(self, params: Any) -> Any:
        """The identity on ``params``, whose backward starts the next update as it makes the grads.

        Apply it to the whole param tree inside the loss of a jitted grad step and call ``update``
        after it as usual: each subgroup streams as soon as the backward has made its grads, and
        ``update`` finishes the step with the grads it is given, bitwise as without overlap (or, if they
        differ, by undoing the early work and streaming again: ``stats.rolled_back``). See
        docs/usage.md, "Overlapping the update with the backward pass".

        Args:
          params: the whole param tree, as given to ``init`` (traced: inside the loss).

        Returns:
          ``params``, unchanged.
        """
        return self._offloader.overlap(params)

    # ----------------------------------------------------------------------------- the tiers

    def flush(self) -> None:
        """Writes every dirty cached record to storage, so the tiers alone hold the newest step."""
        self._offloader.flush()

    def close(self, *, delete: bool = False) -> None:
        """Flushes, stops the threads and lets go of the paths; ``delete=True`` removes the files instead of flushing."""
        self._offloader.close(delete=delete)

    def pin(self) -> Pin:
        """Flushes, then pins the current step so it can be read beside training (what a checkpoint save does).

        Returns:
          The :class:`~jax_mlp.Pin`; call its ``release()`` when done, also on failure.
        """
        return self._offloader.pin()

    def read_pinned(self, pin: Pin, index: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Subgroup ``index``'s state leaves and master leaves at the pinned step, verified, then unpinned."""
        return self._offloader.read_pinned(pin, index)

    def set_caps(self, path: int | str, *, max_read: float | str | None = None, max_write: float | str | None = None):
        """Changes a path's bandwidth caps (by index or name) while training runs; None removes a cap."""
        self._offloader.set_caps(path, max_read=max_read, max_write=max_write)

    # ----------------------------------------------------------------------------- read-only views

    @property
    def stats(self) -> UpdateStats | None:
        """The :class:`~jax_mlp.UpdateStats` of the last ``init`` or ``update``, or None before the first."""
        live = self._offloader.live
        return None if live is None else live.stream.last_stats

    @property
    def config(self) -> OffloadConfig:
        """The validated options."""
        return self._offloader.config

    @property
    def plan(self) -> Plan | None:
        """The subgroups ``init`` made, or None before ``init``."""
        live = self._offloader.live
        return None if live is None else live.plan

    @property
    def step(self) -> int:
        """The step the offloaded state is at (0 before ``init``)."""
        live = self._offloader.live
        return 0 if live is None else live.stream.step

    @property
    def scheduler(self) -> Any:
        """The live order and placement policy, for reading: ``placement``, ``shares``, ``speeds``, ``moves``."""
        return self._offloader.initialised().stream.scheduler

    @property
    def sharding(self) -> Any:
        """Each leaf's sharding and owned shards, as at ``init``."""
        return self._offloader.initialised().sharding

    @property
    def prefetched(self) -> tuple[int, ...]:
        """The subgroups read ahead in idle time for the next update, in the order they were started."""
        return self._offloader.initialised().stream.prefetched

    @property
    def idle_io_done(self) -> bool:
        """Whether the idle-time write-back the last update started has finished."""
        return self._offloader.initialised().stream.idle_io_done

    @property
    def jit_layout(self) -> Any:
        """The mesh, specs and host CPU device the in-jit route runs on, or None where it cannot serve."""
        return self._offloader.initialised().in_jit.layout

    def plan_for(self, params: Any) -> Plan:
        """The subgroups ``init`` gives params of these shapes, dtypes and shardings, after the optimizer check."""
        return self._offloader.plan_for(params)

    def init_from(self, params: Any, step: int, load: Callable[[int], tuple]) -> OffloadState:
        """Like ``init``, but the tiers start at ``step`` with the state ``load(k)`` gives each subgroup k of
        :meth:`plan_for` (a checkpoint restore)."""
        return self._offloader.init_from(params, step, load)


def mlp_offload(
    inner: optax.GradientTransformation,
    *,
    resume: bool = False,
    on_stats: Callable[[UpdateStats], None] | None = None,
    log_to: str | os.PathLike | None = None,
    **options: Unpack[OffloadOptions],
) -> OffloadTransformation:
    """Wraps an element-wise optax optimizer so its state lives in host RAM and on disk, not on device.

    Put global transformations such as ``optax.clip_by_global_norm`` before it in an ``optax.chain``:
    ``mlp_offload`` sees one subgroup of leaves at a time.

    Args:
      inner: the optimizer whose state is offloaded, e.g. ``optax.adamw(1e-3)``. It must act leaf by
        leaf (adam, adamw, lion, sgd, rmsprop, ...): ``init`` checks it, and raises
        :class:`~jax_mlp.CoupledOptimizerError` for one that reads across leaves. Leaves whose rows
        it mixes (adafactor, lamb, lars, muon) are never split.
    {options}
      resume: reopen the tiers at their last complete step instead of writing a fresh initial state.
      on_stats: called with the :class:`UpdateStats` of each update and of a fresh (not resumed) init,
        e.g. to log them; an exception it raises is logged, never raised.
      log_to: a file to which one JSON line is written per ``init`` and ``update`` (timings, bytes
        and busy time per path, cache hits, placement, and the timed reads, computes and writes);
        emptied first unless ``resume``. ``jax-mlp report`` plots it.

    The options from ``paths`` to ``transfer`` are the fields of :class:`OffloadConfig`,
    validated there; ``paths`` is required.

    Trees come back as they went in: ``update`` returns the updates in the grads' tree and ``apply``
    the params in theirs (NNX ``Variable``s, ``FrozenDict``s and other pytree nodes kept), as plain
    optax does; masks and other trees the inner optimizer holds may be built from the params given to
    ``init``. Called inside ``jax.jit``, ``update`` runs on the host CPU and says so once on the
    ``jax_mlp`` logger; the split step (jitted grads, eager ``update``) keeps it on the device.

    Returns:
      An :class:`OffloadTransformation`: an ``optax.GradientTransformationExtraArgs`` whose ``init``
      returns an :class:`OffloadState`, and the one handle on the offload (``apply``, ``overlap``,
      ``stats``, ``flush``, ``close``, checkpoints).

    Example:
      >>> import tempfile
      >>> import jax, jax.numpy as jnp, optax, jax_mlp
      >>> def f(x): return jnp.sum(x ** 2)
      >>> params = jnp.array([1., 2., 3.])
      >>> with jax_mlp.mlp_offload(optax.adam(0.1), paths=[tempfile.mkdtemp()]) as offload:
      ...   tx = optax.chain(optax.clip_by_global_norm(1.0), offload)  # global transformations go first
      ...   opt_state = tx.init(params)
      ...   for _ in range(3):
      ...     updates, opt_state = tx.update(jax.grad(f)(params), opt_state, params)
      ...     params = optax.apply_updates(params, updates)
      ...     print(f"objective {f(params):.3f}")
      objective 12.830
      objective 11.720
      objective 10.671
    """
    config = OffloadConfig.of(options, "mlp_offload")
    on_stats = stats_callback(on_stats, log_to, resume=resume)
    offloader = Offloader(inner, config, resume=resume, on_stats=on_stats)
    return OffloadTransformation(offloader.init, offloader.update)


def _signature() -> inspect.Signature:
    """``mlp_offload``'s signature with the config's options spelled out, so ``help`` and IDEs show every option."""
    own = inspect.signature(mlp_offload)
    options = [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in inspect.signature(OffloadConfig).parameters.values()
    ]
    kept = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    return inspect.Signature([kept[0], *options, *kept[1:]], return_annotation=own.return_annotation)


mlp_offload.__signature__ = _signature()
mlp_offload.__doc__ = mlp_offload.__doc__.replace(
    "    {options}\n", "".join(f"    {line}\n" for line in OffloadConfig.options_doc().splitlines())
)


def offloader_of(offload: OffloadTransformation) -> Offloader:
    """The private offloader behind what :func:`mlp_offload` returned, for the checkpoint handlers.

    Raises:
      TypeError: ``offload`` is not what ``mlp_offload`` returned (an ``optax.chain`` holding it, say).
    """
    if isinstance(offload, OffloadTransformation):
        return offload._offloader
    raise TypeError(
        f"expected what jax_mlp.mlp_offload returned, got {type(offload).__name__}: pass the mlp_offload(...) "
        "object itself, not an optax.chain holding it"
    )


def restore_params(offload: OffloadTransformation, params_like: Any) -> Any:
    """The params at the offload's step, from its master copy in the tiers: resume after a crash.

    Each leaf is ``master.astype(param dtype)``, which is exactly what training had applied, so a
    run resumed with ``mlp_offload(..., resume=True)`` needs no checkpoint. Reads stream subgroup by
    subgroup; the result takes the params' memory once.

    Args:
      offload: an initialised ``mlp_offload`` with ``master_dtype`` (typically just resumed).
      params_like: the params' tree of arrays or ``jax.ShapeDtypeStruct``s: structure, shapes, dtypes
        and, if present, shardings of the result.

    Returns:
      The params, as jax arrays placed like ``params_like`` (default device if it has no sharding).

    Raises:
      OffloadError: before ``init``, without ``master_dtype``, with remainder masters, or for a
        ``params_like`` of another tree than ``init``'s.

    Example:
      >>> import tempfile
      >>> import jax.numpy as jnp, optax, jax_mlp
      >>> params = {"w": jnp.array([1., 2., 3.], jnp.bfloat16)}
      >>> options = dict(paths=[tempfile.mkdtemp()], master_dtype=jnp.float32)
      >>> with jax_mlp.mlp_offload(optax.adam(0.1), **options) as offload:
      ...   opt_state = offload.init(params)
      ...   params, opt_state = offload.apply({"w": jnp.ones(3, jnp.bfloat16)}, opt_state, params)
      >>> with jax_mlp.mlp_offload(optax.adam(0.1), resume=True, **options) as offload:  # after a crash, say
      ...   opt_state = offload.init(params)
      ...   restored = jax_mlp.restore_params(offload, params)
      >>> restored["w"]
      Array([0.898438, 1.89844, 2.90625], dtype=bfloat16)
      >>> bool((restored["w"] == params["w"]).all())
      True
    """
    return params_from_masters(offloader_of(offload), params_like)
