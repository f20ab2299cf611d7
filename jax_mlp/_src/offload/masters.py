"""The params at the offload's step, from the master copy in its tiers, with no checkpoint (``restore_params``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_mlp._src.errors import OffloadError
from jax_mlp._src.offload.inputs import check_tree
from jax_mlp._src.offload.offloader import Offloader
from jax_mlp._src.plan import partition, remainders
from jax_mlp._src.plan.partition import Box
from jax_mlp._src.stream.engine import Engine


def params_from_masters(offloader: Offloader, params_like: Any) -> Any:
    """The params at the offload's step, from the whole masters in its tiers (``jax_mlp.restore_params``).

    Each leaf is ``master.astype(param dtype)``, exactly what training had applied. The step is pinned
    and read subgroup by subgroup; the result takes the params' memory once, placed like ``params_like``.
    """
    if offloader.live is None:
        raise OffloadError("restore_params needs an initialised mlp_offload: create it with resume=True and call init")
    plan, sharding = offloader.live.plan, offloader.live.sharding
    if plan.master_dtype is None:
        raise OffloadError(
            "this mlp_offload keeps no master params (master_dtype=None), so the tiers cannot give the params back; "
            "restore them from a checkpoint"
        )
    if any(any(remainders.held_as_remainders(sg.layout.master_fields)) for sg in plan.subgroups):
        raise OffloadError(
            "this mlp_offload keeps its fp32 masters as remainders (master_storage='remainder'): the tiers hold "
            "only their low halves, the params being the high halves, so they cannot give the params back; restore "
            "the params from your checkpoint, or run with master_storage='full' to resume from the tiers alone"
        )
    likes = check_tree(plan, params_like, "params_like", check_dtype=True)
    blocks: dict[tuple[int, Box | None], np.ndarray] = {}  # by leaf and owned shard's box (None: on one device)

    def convert(index: int, fetched: tuple) -> None:
        for piece, master in zip(plan.subgroups[index].pieces, fetched[1], strict=True):
            spec = plan.leaves[piece.leaf]
            value = np.asarray(jnp.asarray(master).astype(spec.dtype))
            key = (piece.leaf, None if piece.shard is None else piece.shard.box)
            if piece.rows is None:
                blocks[key] = value
            else:
                shape = spec.shape if piece.shard is None else piece.shard.shape
                blocks.setdefault(key, np.empty(shape, value.dtype))[piece.rows[0] : piece.rows[1]] = value

    pin = offloader.pin()
    config = offloader.config
    engine = Engine(config.prefetch_depth, config.write_depth, config.io_timeout)
    try:
        engine.pipeline(range(len(plan.subgroups)), lambda k: offloader.read_pinned(pin, k), convert, lambda *_: None)
    finally:
        engine.close()
        pin.release()
    placed = [
        _placed(index, spec.shape, sharding.shardings[index], getattr(like, "sharding", None), blocks)
        for index, (spec, like) in enumerate(zip(plan.leaves, likes, strict=True))
    ]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params_like), placed)


def _placed(
    index: int,
    shape: tuple[int, ...],
    sharding: jax.sharding.Sharding | None,
    target: jax.sharding.Sharding | None,
    blocks: dict[tuple[int, Box | None], np.ndarray],
) -> jax.Array:
    """Leaf ``index`` as a jax array placed with ``target``, from its host blocks (sharded as at ``init``)."""
    if sharding is None:
        return jax.device_put(blocks[index, None], target)
    array = jax.make_array_from_callback(shape, sharding, lambda at: blocks[index, partition.shard_box(at, shape)])
    return array if target is None or target == sharding else jax.device_put(array, target)
