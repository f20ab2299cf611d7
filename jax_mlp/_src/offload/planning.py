"""Planning one offload: the optimizer check, the subgroups of the params, and the state stream built for them."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_mlp._src.config import OffloadConfig
from jax_mlp._src.plan import optimizer_check, partition
from jax_mlp._src.plan.partition import Plan
from jax_mlp._src.plan.programs import Programs
from jax_mlp._src.plan.sharding import LeafSharding
from jax_mlp._src.schedule.performance import starting_speed
from jax_mlp._src.schedule.scheduler import Scheduler
from jax_mlp._src.stats import UpdateStats
from jax_mlp._src.storage.cache import HostCache
from jax_mlp._src.storage.paths import PathStore
from jax_mlp._src.storage.record import HEADER_SIZE, record_codec
from jax_mlp._src.storage.tier_stack import TierStack
from jax_mlp._src.stream.engine import Engine
from jax_mlp._src.stream.state_stream import StateStream


class Planned(NamedTuple):
    """The plan of some params, with what ``init`` needs of them besides."""

    key: Any
    plan: Plan
    sharding: LeafSharding
    leaves: list[Any]
    notes: dict[str, Any]
    reads_params: bool  # whether inner.update reads the params (the optimizer check says)


def plan_params(inner: optax.GradientTransformationExtraArgs, config: OffloadConfig, params: Any, key: Any) -> Planned:
    """Checks the optimizer on ``params`` (their shapes), then plans their subgroups; warns of oversized leaves."""
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
    )
    oversized = partition.oversized_whole_leaves(plan, check.whole_leaves, config.subgroup_size)
    _warn_of(oversized, plan, config.subgroup_size)
    notes = {"check_s": check.seconds, "whole_leaf_subgroups": oversized}
    return Planned(key, plan, sharding, leaves, notes, check.reads_params)


def signature(leaf: Any) -> tuple:
    """What a plan depends on of a param leaf: its shape, dtype and sharding."""
    return tuple(np.shape(leaf)), jnp.result_type(leaf), getattr(leaf, "sharding", None)


def open_stream(
    inner: optax.GradientTransformationExtraArgs,
    config: OffloadConfig,
    plan: Plan,
    paths: list[PathStore],
    peer_key: str,
    on_stats: Callable[[UpdateStats], None] | None,
    notes: dict[str, Any],
) -> StateStream:
    """The state stream of ``plan`` on opened ``paths``: its programs, scheduler (from each path's
    declared or probed speed), tiers and engine."""
    scheduler = Scheduler(
        [HEADER_SIZE + subgroup.layout.nbytes for subgroup in plan.subgroups],
        [starting_speed(path, config.probe) for path in config.paths],
        order=config.order,
        placement=config.placement,
        rebalance=config.rebalance,
    )
    tiers = TierStack(
        HostCache(config.host_cache),
        paths,
        plan.layout_hash,
        record_codec([sg.layout for sg in plan.subgroups], plan.layout_hash),
    )
    engine = Engine(config.prefetch_depth, config.write_depth, config.io_timeout)
    return StateStream(
        config,
        plan,
        Programs(inner, plan),
        scheduler,
        tiers,
        engine,
        peer_key=peer_key,
        on_stats=on_stats,
        init_notes=notes,
    )


def _warn_of(oversized: dict[str, int], plan: Plan, subgroup_size: int) -> None:
    for leaf, index in oversized.items():
        warnings.warn(
            f"param {leaf} is kept whole in subgroup {index}, of {plan.subgroups[index].layout.nbytes} bytes, above "
            f"subgroup_size={subgroup_size}: its optimizer mixes its rows (adafactor, lamb, lars and muon do), so "
            "cutting it into row chunks would change the math. Expect that subgroup to take more memory and time",
            stacklevel=6,
        )
