"""Planning one offload: the optimizer check, then the subgroups of the params, and what ``init`` needs of them."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_mlp._src.config import OffloadConfig
from jax_mlp._src.plan import optimizer_check, partition
from jax_mlp._src.plan.partition import Plan
from jax_mlp._src.plan.sharding import LeafSharding


class Planned(NamedTuple):
    """The plan of some params, with what ``init`` needs of them besides."""

    key: Any
    plan: Plan
    sharding: LeafSharding
    leaves: list[Any]
    notes: dict[str, Any]
    reads_params: bool  # whether inner.update reads the params (the optimizer check says)


def plan_params(
    inner: optax.GradientTransformationExtraArgs,
    config: OffloadConfig,
    params: Any,
    key: Any,
    unit_of: Sequence[int] | None = None,
    leaf_order: partition.LeafOrder = "natural",
) -> Planned:
    """Checks the optimizer on ``params`` (their shapes), then plans their subgroups; warns of oversized leaves.

    ``unit_of`` gives each leaf's unit for a layer-streamed model (no subgroup spans two), or is None;
    ``leaf_order`` the order pieces are packed in (``"tree"`` for a run planned before 0.3).
    """
    leaves = jax.tree_util.tree_leaves(params)
    sharding = LeafSharding.of(leaves)
    check = optimizer_check.check_optimizer(inner, params, config.master_dtype, dict(config.extra_args))
    plan = partition.make_plan(
        params,
        inner,
        config.subgroup_size,
        config.master_dtype,
        sharding.shards,
        whole_leaves=check.whole_leaves,
        master_storage=config.master_storage,
        unit_of=unit_of,
        leaf_order=leaf_order,
    )
    oversized = partition.oversized_whole_leaves(plan, check.whole_leaves, config.subgroup_size)
    _warn_of(oversized, plan, config.subgroup_size)
    notes = {"check_s": check.seconds, "whole_leaf_subgroups": oversized}
    return Planned(key, plan, sharding, leaves, notes, check.reads_params)


def signature(leaf: Any) -> tuple:
    """What a plan depends on of a param leaf: its shape, dtype and sharding."""
    return tuple(np.shape(leaf)), jnp.result_type(leaf), getattr(leaf, "sharding", None)


def _warn_of(oversized: dict[str, int], plan: Plan, subgroup_size: int) -> None:
    for leaf, index in oversized.items():
        warnings.warn(
            f"param {leaf} is kept whole in subgroup {index}, of {plan.subgroups[index].layout.nbytes} bytes, above "
            f"subgroup_size={subgroup_size}: its optimizer mixes its rows (adafactor, lamb, lars and muon do), so "
            "cutting it into row chunks would change the math. Expect that subgroup to take more memory and time",
            stacklevel=6,
        )
