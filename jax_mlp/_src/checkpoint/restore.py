"""Restoring: any orbax PyTree checkpoint in the standard optax layout streamed into a new offload's tiers.

The checkpoint may come from ``OffloadSave`` or from plain optax (OCDBT or not), and the offload may
use any plan: other paths, subgroup size, host cache, mesh or number of processes. Its arrays are
opened (nothing is read), then each subgroup reads its own regions, cast to the record's dtypes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import tensorstore as ts

from jax_mlp._src import state_codecs
from jax_mlp._src.checkpoint.items import METADATA_KEY, StreamedLeaf, pytree_handler
from jax_mlp._src.checkpoint.layout import (
    MASTER,
    STATE,
    Region,
    abstract_params,
    host_block,
    layout_of,
    region_of,
    standard_layout,
)
from jax_mlp._src.errors import OffloadError
from jax_mlp._src.offload.layers import LayerStream
from jax_mlp._src.offload.offloader import Offloader
from jax_mlp._src.plan import layers as layer_plans
from jax_mlp._src.plan import partition, remainders
from jax_mlp._src.plan.partition import Plan
from jax_mlp._src.state import OffloadState
from jax_mlp._src.storage.record import RecordLayout

if TYPE_CHECKING:
    from etils import epath


class _Saved(NamedTuple):
    """What a checkpoint item says of itself: the ``jax_mlp`` entry of its custom metadata, if any."""

    step: int | None
    has_master: bool
    has_params: bool


def _saved(directory: epath.Path) -> _Saved:
    try:
        metadata = ocp.PyTreeCheckpointHandler().metadata(directory)
    except FileNotFoundError as error:
        raise OffloadError(f"{directory} holds no orbax PyTree checkpoint ({error})") from error
    custom = (metadata.custom_metadata or {}).get(METADATA_KEY)
    if custom is None:  # plain optax
        return _Saved(None, False, False)
    return _Saved(int(custom["step"]), bool(custom["master"]), bool(custom.get("params", False)))


def _restore_item(expected: Any, master_dtype: Any, saved: _Saved, with_params: bool) -> tuple[Any, Any]:
    """The tree to restore from the checkpoint, and the name of each of its leaves in ``expected``."""
    names = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(expected), partition.paths_of(expected))
    if with_params:  # a dict of parts either way: a master copy the checkpoint lacks starts from the params
        return tuple({k: v for k, v in tree.items() if k != MASTER or saved.has_master} for tree in (expected, names))
    if master_dtype is None and saved.has_master:
        return {STATE: expected}, {STATE: names}
    if master_dtype is not None and not saved.has_master:
        return expected[STATE], names[STATE]
    return expected, names


def _open_arrays(
    directory: epath.Path,
    inner: optax.GradientTransformation,
    master_dtype: Any,
    params: Any,
    saved: _Saved,
    with_params: bool = False,
) -> dict[str, Any]:
    """Opens the arrays to restore, keyed by their path in the run's standard layout; reads nothing."""
    layout = standard_layout(inner, params, master_dtype, with_params=with_params)
    item, names = _restore_item(layout, master_dtype, saved, with_params)
    restore = ocp.args.PyTreeRestore(
        item=item,
        restore_args=jax.tree.map(lambda _: ocp.type_handlers.RestoreArgs(restore_type=StreamedLeaf), item),
        partial_restore=saved.has_master and master_dtype is None,
    )
    try:
        opened = pytree_handler().restore(directory, args=restore)
    except (ValueError, KeyError) as error:
        raise OffloadError(
            f"checkpoint {directory} does not hold the state of this optimizer for these params ({error}); restore "
            "with the inner optimizer and params it was saved with"
        ) from error
    arrays = {}
    for name, want, array in zip(
        jax.tree.leaves(names),
        jax.tree.leaves(item),
        jax.tree.leaves(opened, is_leaf=lambda x: isinstance(x, ts.TensorStore)),
        strict=True,
    ):
        if tuple(array.shape) != tuple(want.shape):
            raise OffloadError(
                f"checkpoint {directory} holds {name} with shape {tuple(array.shape)}, but these params need "
                f"{tuple(want.shape)}; restore with the params it was saved with"
            )
        arrays[name] = array
    return arrays


class _Restore:
    """The reads of one restore: each subgroup's record fields from the checkpoint's arrays.

    With ``param_layouts`` (a layer stream's params records, by subgroup) the params come from the
    checkpoint too, and a master copy it lacks starts from them; else from ``params``.
    """

    def __init__(
        self,
        inner: optax.GradientTransformation,
        plan: Plan,
        arrays: dict[str, Any],
        params: Any,
        param_layouts: Sequence[RecordLayout] | None = None,
    ):
        self.plan = plan
        self.layout = layout_of(inner, plan, param_layouts is not None)
        self.arrays = [arrays.get(name) for name in self.layout.names]
        self.params = jax.tree.leaves(params)
        self.param_layouts = param_layouts
        self.codes = state_codecs.int8_codes(jax.tree_util.tree_unflatten(self.layout.treedef, self.layout.leaves))

    def _master_from_params(self, region: Region, leaf: int, params_read: Any) -> np.ndarray:
        """A master the checkpoint lacks: the checkpoint's params (``params_read``, a layer stream's), or the user's."""
        if params_read is not None:
            return np.asarray(params_read.result())
        return host_block(self.params[leaf], region.box).astype(self.plan.master_dtype)

    def _check_codes(self, value: np.ndarray, region: Region) -> None:
        """Refuses int8 codes of an older format; only whole rows hold their blocks' words."""
        if value.ndim and value.shape[-1] == self.arrays[region.leaf].shape[-1]:
            state_codecs.check_int8_format(value, f"checkpoint array {self.layout.names[region.leaf]}")

    def load(self, index: int) -> tuple[list[np.ndarray], ...]:
        """Subgroup ``index``'s state and master leaves, read from the checkpoint (or the params), and, with
        ``param_layouts``, its params leaves."""
        subgroup = self.plan.subgroups[index]
        regions = self.layout.regions[index]
        params = () if self.param_layouts is None else self.param_layouts[index].state_fields
        fields = [*subgroup.layout.state_fields, *subgroup.layout.master_fields, *params]
        reads = [None if self.arrays[r.leaf] is None else region_of(self.arrays[r.leaf], r).read() for r in regions]
        split, masters = len(subgroup.layout.state_fields), len(subgroup.layout.master_fields)
        params_reads = reads[split + masters :] or [None] * masters  # the checkpoint's params, piece by piece
        values = []
        for i, (region, field, read) in enumerate(zip(regions, fields, reads, strict=True)):
            if read is None:  # only a master lacks its array
                value = self._master_from_params(region, subgroup.pieces[i - split].leaf, params_reads[i - split])
            else:
                value = read.result()
            if field.dtype == remainders.REMAINDER_DTYPE and split <= i < split + masters:
                value = remainders.split(np.asarray(value, np.float32))[1]
            if read is not None and self.codes[region.leaf]:
                self._check_codes(np.asarray(value), region)
            values.append(np.asarray(value).astype(field.dtype, copy=False))
        parts = values[:split], values[split : split + masters]
        return parts if self.param_layouts is None else (*parts, values[split + masters :])


def restore_into(offloader: Offloader, directory: epath.Path, params: Any, step: int | None) -> OffloadState:
    """Streams the checkpoint in ``directory`` into the tiers of ``offloader``, which it initialises.

    Args:
      offloader: a new, uninitialised offloader.
      directory: the checkpoint item's directory.
      params: the params, or their ``jax.ShapeDtypeStruct``s (values when a master copy starts from them).
      step: the step of the restored state; None for the one saved (0 for a plain optax checkpoint).

    Returns:
      The :class:`~jax_mlp.OffloadState` at the restored step.
    """
    if offloader.live is not None:
        raise OffloadError(
            "OffloadRestore needs a fresh mlp_offload, but this one is initialised; create a new one (on the same "
            "paths or empty ones) and do not call its init: the restore does"
        )
    saved = _saved(directory)
    abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
    if offloader.config.master_dtype is not None and not saved.has_master and abstract:
        raise OffloadError(
            f"checkpoint {directory} has no master params, so the master copy starts from the params: pass the "
            "params' values, not their shapes, in OffloadRestore(params=...)"
        )
    arrays = _open_arrays(directory, offloader.inner, offloader.config.master_dtype, params, saved)
    step = step if step is not None else saved.step or 0

    plan = offloader.plan_for(params)
    return offloader.init_from(params, step, _Restore(offloader.inner, plan, arrays, params).load)


def restore_layers(stream: LayerStream, directory: epath.Path, params: Any, step: int | None) -> OffloadState:
    """Streams the checkpoint of a ``stream_layers`` run in ``directory`` into the tiers of ``stream``, which it
    initialises: each subgroup's state record and its params record, from the checkpoint's regions.

    Args:
      stream: a new, uninitialised ``stream_layers``.
      directory: the checkpoint item's directory, saved by ``OffloadSave`` of a ``stream_layers``.
      params: ``(outer, layers)`` as ``init`` takes them: arrays or ``jax.ShapeDtypeStruct``s, the layers
        stacked on axis 0 (with their sharding, where they span devices).
      step: the step of the restored state; None for the one saved.

    Returns:
      The :class:`~jax_mlp.OffloadState` at the restored step.
    """
    saved = _saved(directory)
    if not saved.has_params:
        raise OffloadError(
            f"checkpoint {directory} holds no params, so it cannot start a stream_layers run (whose params live in "
            "the tiers); restore a checkpoint saved by OffloadSave(stream) of a stream_layers run"
        )
    outer, layers = params
    plan = stream.plan_for(outer, *layer_plans.layer_shapes(layers))
    model = abstract_params(plan.plan)
    arrays = _open_arrays(directory, stream.inner, stream.config.master_dtype, model, saved, with_params=True)
    load = _Restore(stream.inner, plan.plan, arrays, None, plan.param_layouts).load
    return stream.init_from(plan, saved.step if step is None else step, load)
