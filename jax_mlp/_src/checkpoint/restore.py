"""Restoring: any orbax PyTree checkpoint in the standard optax layout streamed into a new offload's tiers.

The checkpoint may come from ``OffloadSave`` or from plain optax (OCDBT or not), and the offload may
use any plan: other paths, subgroup size, host cache, mesh or number of processes. Its arrays are
opened (nothing is read), then each subgroup reads its own regions, cast to the record's dtypes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import tensorstore as ts

from jax_mlp._src import state_codecs
from jax_mlp._src.checkpoint.items import METADATA_KEY, StreamedLeaf, pytree_handler
from jax_mlp._src.checkpoint.layout import STATE, Region, host_block, layout_of, region_of, standard_layout
from jax_mlp._src.errors import OffloadError
from jax_mlp._src.offload.offloader import Offloader
from jax_mlp._src.plan import partition, remainders
from jax_mlp._src.plan.partition import Plan
from jax_mlp._src.state import OffloadState

if TYPE_CHECKING:
    from etils import epath


class _Saved(NamedTuple):
    """What a checkpoint item says of itself: the ``jax_mlp`` entry of its custom metadata, if any."""

    step: int | None
    has_master: bool


def _saved(directory: epath.Path) -> _Saved:
    try:
        metadata = ocp.PyTreeCheckpointHandler().metadata(directory)
    except FileNotFoundError as error:
        raise OffloadError(f"{directory} holds no orbax PyTree checkpoint ({error})") from error
    custom = (metadata.custom_metadata or {}).get(METADATA_KEY)
    if custom is None:  # plain optax
        return _Saved(None, False)
    return _Saved(int(custom["step"]), bool(custom["master"]))


def _restore_item(expected: Any, master_dtype: Any, saved: _Saved) -> tuple[Any, Any]:
    """The tree to restore from the checkpoint, and the name of each of its leaves in ``expected``."""
    names = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(expected), partition.paths_of(expected))
    if master_dtype is None and saved.has_master:
        return {STATE: expected}, {STATE: names}
    if master_dtype is not None and not saved.has_master:
        return expected[STATE], names[STATE]
    return expected, names


def _open_arrays(directory: epath.Path, offloader: Offloader, params: Any, saved: _Saved) -> dict[str, Any]:
    """Opens the arrays to restore, keyed by their path in the offload's standard layout; reads nothing."""
    master_dtype = offloader.config.master_dtype
    item, names = _restore_item(standard_layout(offloader.inner, params, master_dtype), master_dtype, saved)
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
    """The reads of one restore: each subgroup's record fields from the checkpoint's arrays."""

    def __init__(self, inner: optax.GradientTransformation, plan: Plan, arrays: dict[str, Any], params: Any):
        self.plan = plan
        self.layout = layout_of(inner, plan)
        self.arrays = [arrays.get(name) for name in self.layout.names]
        self.params = jax.tree.leaves(params)
        self.codes = state_codecs.int8_codes(jax.tree_util.tree_unflatten(self.layout.treedef, self.layout.leaves))

    def _master_from_params(self, region: Region, leaf: int) -> np.ndarray:
        return host_block(self.params[leaf], region.box).astype(self.plan.master_dtype)

    def _check_codes(self, value: np.ndarray, region: Region) -> None:
        """Refuses int8 codes of an older format; only whole rows hold their blocks' words."""
        if value.ndim and value.shape[-1] == self.arrays[region.leaf].shape[-1]:
            state_codecs.check_int8_format(value, f"checkpoint array {self.layout.names[region.leaf]}")

    def load(self, index: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Subgroup ``index``'s state and master leaves, read from the checkpoint (or the params)."""
        subgroup = self.plan.subgroups[index]
        regions = self.layout.regions[index]
        fields = [*subgroup.layout.state_fields, *subgroup.layout.master_fields]
        reads = [None if self.arrays[r.leaf] is None else region_of(self.arrays[r.leaf], r).read() for r in regions]
        split = len(subgroup.layout.state_fields)
        values = []
        for i, (region, field, read) in enumerate(zip(regions, fields, reads, strict=True)):
            value = self._master_from_params(region, subgroup.pieces[i - split].leaf) if read is None else read.result()
            if field.dtype == remainders.REMAINDER_DTYPE and i >= split:
                value = remainders.split(np.asarray(value, np.float32))[1]
            if read is not None and self.codes[region.leaf]:
                self._check_codes(np.asarray(value), region)
            values.append(np.asarray(value).astype(field.dtype, copy=False))
        return values[:split], values[split:]


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
    arrays = _open_arrays(directory, offloader, params, saved)
    step = step if step is not None else saved.step or 0

    plan = offloader.plan_for(params)
    return offloader.init_from(params, step, _Restore(offloader.inner, plan, arrays, params).load)
