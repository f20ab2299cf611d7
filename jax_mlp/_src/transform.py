"""``mlp_offload``: the optax face of the offloaded optimizer.

Options in, an ``optax.GradientTransformationExtraArgs`` out. The user holds only
:class:`~jax_mlp.OffloadState`, a step counter and the shared state; the :class:`~jax_mlp.Offloader`
behind the transformation keeps the inner optimizer's state in the tiers.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import optax

from jax_mlp._src.config import OffloadConfig
from jax_mlp._src.offload.offloader import ClosesOnExit, Offloader, OffloadState
from jax_mlp._src.stats import StatsLog, UpdateStats, fan_out

__all__ = ["OffloadState", "OffloadTransformation", "Offloader", "mlp_offload"]


class OffloadTransformation(optax.GradientTransformationExtraArgs, ClosesOnExit):
    """What :func:`mlp_offload` returns: an optax transformation with a handle on its offloader."""

    __slots__ = ()

    @property
    def offloader(self) -> Offloader:
        """The live :class:`Offloader`, whose bound methods ``init`` and ``update`` are (and ``apply`` calls)."""
        return self.init.__self__

    @property
    def stats(self) -> UpdateStats | None:
        """Statistics of the last ``init`` or ``update``."""
        return self.offloader.last_stats

    def apply(self, grads: Any, opt_state: OffloadState, params: Any, **extra_args: Any) -> tuple[Any, OffloadState]:
        """The fused update: ``(new_params, opt_state)``, written over the donated params; see :meth:`Offloader.apply`."""
        return self.offloader.apply(grads, opt_state, params, **extra_args)

    def apply_to(self, model: Any, grads: Any, opt_state: OffloadState, **extra_args: Any) -> OffloadState:
        """The fused :meth:`apply` on a flax NNX model: its ``nnx.Param`` values are replaced in place.

        Args:
          model: the ``nnx.Module`` whose ``nnx.Param`` state was given to ``init``.
          grads: the gradients of those params (e.g. from ``nnx.grad``), after any global clipping.
          opt_state: the :class:`OffloadState` of the previous step.
          **extra_args: as for :meth:`Offloader.update`.

        Returns:
          The new :class:`OffloadState`.
        """
        from flax import nnx  # flax is an optional dependency

        params, opt_state = self.apply(grads, opt_state, nnx.state(model, nnx.Param), **extra_args)
        nnx.update(model, params)
        return opt_state

    def overlap(self, params: Any) -> Any:
        """The params, unchanged; inside the loss, their backward starts the next ``update``: see :meth:`Offloader.overlap`."""
        return self.offloader.overlap(params)

    def flush(self) -> None:
        """See :meth:`Offloader.flush`."""
        self.offloader.flush()

    def close(self, *, delete: bool = False) -> None:
        """See :meth:`Offloader.close`."""
        self.offloader.close(delete=delete)


def mlp_offload(
    inner: optax.GradientTransformation,
    *,
    resume: bool = False,
    on_stats: Callable[[UpdateStats], None] | None = None,
    log_to: str | os.PathLike | None = None,
    **options: Any,
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
      An ``optax.GradientTransformationExtraArgs`` whose ``init`` returns an :class:`OffloadState` and
      which also exposes ``apply()`` (the fused update that writes the new params over the old),
      ``stats``, ``flush()`` and ``close()``.

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
    unknown = sorted(set(options) - set(inspect.signature(OffloadConfig).parameters))
    if unknown:
        raise TypeError(f"mlp_offload() got unexpected keyword arguments {unknown}; see help(jax_mlp.mlp_offload)")
    config = OffloadConfig(**options)
    if log_to is not None:
        on_stats = fan_out(StatsLog(log_to, append=resume), on_stats)
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


def offloader_of(offload: OffloadTransformation | Offloader) -> Offloader:
    """The :class:`Offloader` behind what :func:`mlp_offload` returned (or the offloader itself)."""
    if isinstance(offload, OffloadTransformation):
        return offload.offloader
    if isinstance(offload, Offloader):
        return offload
    raise TypeError(f"expected what jax_mlp.mlp_offload returned, got {type(offload).__name__}")
