"""Orbax checkpoints of the offloaded state, in the standard optax layout, streamed subgroup by subgroup.

A checkpoint item holds the tree that ``inner.init(params)`` returns, or, with master params,
``{"opt_state": <that tree>, "master": <params in master_dtype>}``; of a ``stream_layers`` run, whose
params live in the tiers, ``{"opt_state": ..., "params": <the model tree>}`` (and ``"master"``), the
params streamed from their records as the state is. It is orbax's own PyTree format
(zarr3 arrays, no OCDBT), so plain optax restores it with ``ocp.args.StandardRestore``. Each array is
filled region by region while the subgroups stream from the tiers: a row chunk of a split leaf is a
row range (and a zarr3 chunk) of its array, and leaves every subgroup holds alike (adam's ``count``)
are written once. Sharded params save their blocks: each block is a region of its array, written
once over all processes, by the one holding its replica 0. Restoring streams the other way, from any
orbax PyTree checkpoint (also OCDBT ones written by plain optax), into any plan: other paths,
subgroup size, host cache, mesh or number of processes; each process reads its own blocks' regions.
The layout and its regions are :mod:`~jax_mlp._src.checkpoint.layout`'s; saving is
:mod:`~jax_mlp._src.checkpoint.save`'s, restoring :mod:`~jax_mlp._src.checkpoint.restore`'s.

See docs/checkpoints.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from typing import TYPE_CHECKING, Any

import orbax.checkpoint as ocp

from jax_mlp._src.checkpoint import items
from jax_mlp._src.checkpoint.restore import restore_into, restore_layers
from jax_mlp._src.checkpoint.save import SaveStream, layer_source, offload_source
from jax_mlp._src.errors import OffloadError
from jax_mlp._src.offload.layers import LayerStream
from jax_mlp._src.state import OffloadState
from jax_mlp._src.transform import OffloadTransformation, offloader_of

if TYPE_CHECKING:
    from etils import epath

_SAVES = itertools.count()  # numbers this process's saves alike in every process, for their agreement


@dataclasses.dataclass
class OffloadSave(ocp.args.CheckpointArgs):
    """Saves the state of an ``mlp_offload`` (or a ``stream_layers`` run) at its current step, in the standard optax layout.

    Attributes:
      offload: what :func:`~jax_mlp.mlp_offload` returned, initialised; or a :class:`~jax_mlp.LayerStream`,
        whose checkpoint holds the params too (``{"opt_state", "params"[, "master"]}``, the params as the
        model tree ``{"layers": [layer_0, ...], "outer": outer}``), streamed from the tiers.
      params: the params at the offload's step; needed with ``master_storage="remainder"`` (bf16
        params with fp32 masters), whose records hold only the masters' low halves:
        the checkpoint holds the whole fp32 master, rebuilt from them. Their blocks are copied to the
        host when the save starts, so the params may be updated (or donated) while it streams. Not
        needed for a ``stream_layers`` run: its params records hold them.

    Example:
      >>> import tempfile
      >>> import jax.numpy as jnp, optax, orbax.checkpoint as ocp, jax_mlp
      >>> params = {"w": jnp.array([1., 2., 3.])}
      >>> checkpoints = ocp.CheckpointManager(tempfile.mkdtemp())
      >>> with jax_mlp.mlp_offload(optax.adam(0.1), paths=[tempfile.mkdtemp()]) as offload:
      ...   opt_state = offload.init(params)
      ...   _, opt_state = offload.update({"w": jnp.ones(3)}, opt_state, params)
      ...   items = ocp.args.Composite(params=ocp.args.StandardSave(params), opt_state=jax_mlp.OffloadSave(offload))
      ...   checkpoints.save(1, args=items)  # streams out while training goes on
      ...   checkpoints.wait_until_finished()
      True
    """

    offload: OffloadTransformation | LayerStream
    params: Any = None


@dataclasses.dataclass
class OffloadRestore(ocp.args.CheckpointArgs):
    """Restores a checkpoint in the standard optax layout into a fresh, not yet initialised ``mlp_offload``.

    The checkpoint may come from :class:`OffloadSave` or from plain optax (``ocp.args.StandardSave``
    of ``inner.init(params)``). The ``mlp_offload`` may use other paths, subgroup size and host cache.

    Attributes:
      offload: a new :func:`~jax_mlp.mlp_offload` (without ``resume``); restoring initialises it, so do
        not call its ``init``. Its paths hold no run, or this run's state (the same layout hash, e.g.
        after a crash): the restore replaces that state, with a warning naming the step it held. Or a
        new :func:`~jax_mlp.stream_layers`, for a checkpoint ``OffloadSave`` made of one: its params and
        state stream into the tiers.
      params: the params, or their ``jax.ShapeDtypeStruct``s. Values are needed only when the
        offload keeps master params and the checkpoint has none: the master copy starts from them.
        For a ``stream_layers``, ``(outer, layers)`` as its ``init`` takes them (shapes are enough).
      step: the step of the restored state; by default the one saved, or 0 for a plain optax checkpoint.

    Example (a checkpoint of plain optax, restored into an offload):
      >>> import tempfile
      >>> import jax.numpy as jnp, optax, orbax.checkpoint as ocp, jax_mlp
      >>> params = {"w": jnp.array([1., 2., 3.])}
      >>> inner = optax.adam(0.1)
      >>> state = inner.update({"w": jnp.ones(3)}, inner.init(params), params)[1]  # in memory
      >>> directory = tempfile.mkdtemp() + "/opt_state"
      >>> with ocp.StandardCheckpointer() as saver:
      ...   saver.save(directory, state)
      >>> with jax_mlp.mlp_offload(inner, paths=[tempfile.mkdtemp()]) as offload:  # restoring initialises it
      ...   checkpointer = ocp.Checkpointer(jax_mlp.OffloadCheckpointHandler())
      ...   opt_state = checkpointer.restore(directory, args=jax_mlp.OffloadRestore(offload, params, step=1))
      >>> int(opt_state.step), opt_state.shared[0].count
      (1, Array(1, dtype=int32))
    """

    offload: OffloadTransformation | LayerStream
    params: Any
    step: int | None = None


class OffloadCheckpointHandler(ocp.AsyncCheckpointHandler):
    """The orbax handler of :class:`OffloadSave` and :class:`OffloadRestore`.

    Orbax finds it through the args, so a ``CheckpointManager`` needs no ``item_handlers``. Saving
    flushes the offload and pins its step; the subgroups then stream out in the background while
    training goes on, and an update waits only to overwrite a record the save has not read yet.
    """

    async def async_save(self, directory: epath.Path, args: OffloadSave) -> list | None:
        """Starts saving ``args.offload`` at its current step; returns the futures that finish it."""
        source = (
            layer_source(args.offload)
            if isinstance(args.offload, LayerStream)
            else offload_source(offloader_of(args.offload))
        )
        pin = source.pin()
        try:
            stream = SaveStream(source, pin, f"jax_mlp/save/{next(_SAVES)}/{directory}", args.params)
            has_master = source.plan.master_dtype is not None
            said = {"format": items.FORMAT, "step": pin.step, "master": has_master, "params": source.with_params}
            custom = {items.METADATA_KEY: said}
            save = ocp.args.PyTreeSave(stream.placeholders(), custom_metadata=custom)
            return await items.pytree_handler().async_save(directory, args=save)
        except BaseException:
            pin.release()
            raise

    def save(self, directory: epath.Path, args: OffloadSave) -> None:
        """Saves ``args.offload`` at its current step; returns once the checkpoint is written."""

        async def save() -> list:
            return await self.async_save(directory, args) or []

        for future in asyncio.run(save()):
            future.result()

    def restore(self, directory: epath.Path, args: OffloadRestore | None = None) -> OffloadState:
        """Streams a checkpoint into the tiers of ``args.offload``, which it initialises.

        Returns:
          The :class:`~jax_mlp.OffloadState` at the restored step: the offload's part of the opt_state.
        """
        if args is None:
            raise OffloadError(
                f"restoring {directory} needs a new mlp_offload to restore into: pass "
                "jax_mlp.OffloadRestore(offload, params), or ocp.args.StandardRestore(...) for plain optax"
            )
        if isinstance(args.offload, LayerStream):
            return restore_layers(args.offload, directory, args.params, args.step)
        return restore_into(offloader_of(args.offload), directory, args.params, args.step)

    def metadata(self, directory: epath.Path) -> Any:
        """The item's orbax tree metadata: the shapes and dtypes of the standard layout."""
        return ocp.PyTreeCheckpointHandler().metadata(directory)


ocp.args.register_with_handler(OffloadCheckpointHandler, for_save=True)(OffloadSave)
ocp.args.register_with_handler(OffloadCheckpointHandler, for_restore=True)(OffloadRestore)
