"""A jax_mlp checkpoint item in orbax's terms: the leaf that stands for one array, its handler, its metadata.

The item is orbax's own PyTree format (zarr3 arrays, no OCDBT), so plain optax restores it. Each of
its arrays is one :class:`StreamedLeaf`: saved, its :class:`~jax_mlp._src.checkpoint.save.SaveStream`
writes it region by region; restored, it comes back as an open ``ts.TensorStore`` that is read
region by region.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import orbax.checkpoint as ocp
import tensorstore as ts

FORMAT = 1
"""The version of the item's ``jax_mlp`` metadata."""
METADATA_KEY = "jax_mlp"
"""The key of the item's custom metadata: the format, the step and whether it holds master params."""


class StreamedLeaf:
    """An orbax leaf standing for one array of the standard layout (not a pytree node).

    Saved, it is written by its :class:`SaveStream`; as a restore type, it restores as an open
    ``ts.TensorStore`` that is read region by region.
    """

    def __init__(self, stream: Any, index: int):
        self.stream = stream
        self.index = index


class StreamedLeafHandler(ocp.type_handlers.TypeHandler):
    """The orbax TypeHandler of :class:`StreamedLeaf`: streamed writes, lazy reads."""

    def typestr(self) -> str:
        return "jax.Array"  # what the arrays restore as in plain orbax

    async def metadata(self, infos: Sequence[ocp.type_handlers.ParamInfo]) -> Sequence[Any]:
        return await ocp.type_handlers.ArrayHandler().metadata(infos)

    async def serialize(
        self,
        values: Sequence[StreamedLeaf],
        infos: Sequence[ocp.type_handlers.ParamInfo],
        args: Sequence[ocp.type_handlers.SaveArgs] | None = None,
    ) -> list:
        del args
        stream = values[0].stream

        async def write() -> None:
            await asyncio.gather(*(info.await_path_creation() for info in infos))
            stream.write(values, infos)

        return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="jax_mlp_offload_save")]

    async def deserialize(
        self,
        infos: Sequence[ocp.type_handlers.ParamInfo],
        args: Sequence[ocp.type_handlers.RestoreArgs] | None = None,
    ) -> list:
        del args
        await asyncio.gather(*(info.await_path_creation() for info in infos))
        opened = [
            ts.open(
                ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=bool(info.is_ocdbt_checkpoint)),
                open=True,
                read=True,
                context=info.ts_context,
            )
            for info in infos
        ]
        return list(await asyncio.gather(*opened))


_REGISTRY = ocp.type_handlers.create_type_handler_registry((StreamedLeaf, StreamedLeafHandler()))


class _NoArrayMetadataStore(logging.Filter):
    """Drops orbax's one warning that a registry without ``jax.Array`` does not persist ``ArrayMetadata``.

    That metadata describes ``jax.Array`` shards (for subchunking); the streamed leaves have none and
    are written region by region here, so the warning, logged by every save, says nothing to act on.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No jax.Array in TypeHandlerRegistry")


_ARRAY_METADATA_NOTE = _NoArrayMetadataStore()


def pytree_handler() -> ocp.PyTreeCheckpointHandler:
    """Orbax's PyTree handler, writing plain zarr3 arrays (no OCDBT: each array is filled region by region)."""
    absl_logger = logging.getLogger("absl")  # orbax logs through absl, whose Python logger this is
    absl_logger.addFilter(_ARRAY_METADATA_NOTE)
    try:
        return ocp.PyTreeCheckpointHandler(
            use_ocdbt=False, use_zarr3=True, use_compression=False, type_handler_registry=_REGISTRY
        )
    finally:
        absl_logger.removeFilter(_ARRAY_METADATA_NOTE)
