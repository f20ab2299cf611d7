"""``mlp_offload``: the optax face of the offloaded optimizer.

Options in, an ``optax.GradientTransformationExtraArgs`` out. The user holds only
:class:`~jax_mlp.offloader.OffloadState`, a step counter and the shared state; the
:class:`~jax_mlp.offloader.Offloader` behind the transformation keeps the inner optimizer's state in
the tiers.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable
from typing import Any

import optax

from jax_mlp.config import OffloadConfig
from jax_mlp.offloader import ClosesOnExit, Offloader, OffloadState
from jax_mlp.stats import StatsLog, UpdateStats, fan_out

__all__ = ["OffloadState", "OffloadTransformation", "Offloader", "mlp_offload"]


class OffloadTransformation(optax.GradientTransformationExtraArgs, ClosesOnExit):
    """What :func:`mlp_offload` returns: an optax transformation with a handle on its offloader."""

    __slots__ = ()

    @property
    def offloader(self) -> Offloader:
        """The live :class:`Offloader`, whose bound methods ``init`` and ``update`` are."""
        return self.init.__self__

    @property
    def stats(self) -> UpdateStats | None:
        """Statistics of the last ``init`` or ``update``."""
        return self.offloader.last_stats

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
      resume: reopen the tiers at their last complete step instead of writing a fresh initial state.
      on_stats: called with the :class:`UpdateStats` of each update and of a fresh (not resumed) init,
        e.g. to log them; an exception it raises is logged, never raised.
      log_to: a file to which one JSON line is written per ``init`` and ``update`` (timings, bytes
        and busy time per path, cache hits, placement, and the timed reads, computes and writes);
        emptied first unless ``resume``. ``jax-mlp report`` plots it.
      **options: the fields of :class:`OffloadConfig`, ``paths`` required:
    {options}

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``init`` returns an :class:`OffloadState` and
      which also exposes ``stats``, ``flush()`` and ``close()``.
    """
    unknown = sorted(set(options) - {field.name for field in dataclasses.fields(OffloadConfig)})
    if unknown:
        raise TypeError(f"mlp_offload() got unexpected keyword arguments {unknown}; see help(jax_mlp.mlp_offload)")
    config = OffloadConfig(**options)
    if log_to is not None:
        on_stats = fan_out(StatsLog(log_to, append=resume), on_stats)
    offloader = Offloader(inner, config, resume=resume, on_stats=on_stats)
    return OffloadTransformation(offloader.init, offloader.update)


def _signature() -> inspect.Signature:
    """``mlp_offload``'s signature with the config's fields spelled out, so ``help`` and IDEs show every option."""
    own = inspect.signature(mlp_offload)
    fields = [
        inspect.Parameter(
            field.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default,
            annotation=field.type,
        )
        for field in dataclasses.fields(OffloadConfig)
    ]
    kept = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    return inspect.Signature([kept[0], *fields, *kept[1:]], return_annotation=own.return_annotation)


mlp_offload.__signature__ = _signature()
mlp_offload.__doc__ = mlp_offload.__doc__.replace(
    "    {options}\n", "".join(f"      {line}\n" for line in OffloadConfig.options_doc().splitlines())
)
