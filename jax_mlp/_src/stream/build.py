"""The state stream of a plan on opened paths: its programs, scheduler, tiers and engine, built for ``init``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optax

from jax_mlp._src.config import OffloadConfig
from jax_mlp._src.plan.partition import Plan
from jax_mlp._src.plan.programs import Programs
from jax_mlp._src.schedule.performance import starting_speed
from jax_mlp._src.schedule.scheduler import Scheduler
from jax_mlp._src.stats import UpdateStats
from jax_mlp._src.storage.cache import HostCache
from jax_mlp._src.storage.paths import PathStore
from jax_mlp._src.storage.record import HEADER_SIZE, RecordLayout, record_codec
from jax_mlp._src.storage.tier_stack import TierStack
from jax_mlp._src.stream.engine import Engine
from jax_mlp._src.stream.state_stream import StateStream


def build_stream(
    inner: optax.GradientTransformationExtraArgs,
    config: OffloadConfig,
    plan: Plan,
    paths: list[PathStore],
    peer_key: str,
    on_stats: Callable[[UpdateStats], None] | None,
    notes: dict[str, Any],
    param_layouts: Sequence[RecordLayout] = (),
) -> StateStream:
    """The state stream of ``plan`` on opened ``paths``: its programs, scheduler (from each path's
    declared or probed speed), tiers and engine; with ``param_layouts``, a layer-streamed plan's params
    records beside its state records (see :mod:`jax_mlp._src.plan.layers`)."""
    layouts = [subgroup.layout for subgroup in plan.subgroups] + list(param_layouts)
    scheduler = Scheduler(
        [HEADER_SIZE + layout.nbytes for layout in layouts],
        [starting_speed(path, config.probe) for path in config.paths],
        order=config.order,
        placement=config.placement,
        rebalance=config.rebalance,
        run_on=0 if param_layouts else config.write_depth,
        held=config.idle_prefetch,
    )
    tiers = TierStack(
        HostCache(config.host_cache),
        paths,
        plan.layout_hash,
        record_codec(layouts, plan.layout_hash),
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
        param_layouts=param_layouts,
    )
