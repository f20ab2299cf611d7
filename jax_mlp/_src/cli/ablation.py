"""The paper's ablation: the mechanisms switched on one at a time, each as the performance model predicts it.

MLP-Offload's ablation (Maurya et al., SC'25) adds its mechanisms to a baseline one by one: the
alternating order with the host cache, several paths, the node lock. ``full`` adds ours: a split by
measured bandwidth, rebalanced, and the first reads prefetched in idle time. ``jax-mlp plan`` prints
each variant's predicted update against the baseline, and ``benchmarks/ablation.py`` measures them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from jax_mlp._src.schedule.performance import PathSpeed, Prediction, predict, predict_step


class Variant(NamedTuple):
    """One row of the ablation: which mechanisms are on.

    ``balanced`` is where we go beyond the paper: the split follows measured bandwidth (and is
    rebalanced while running) instead of a fixed ratio, and the idle time before an update
    prefetches its first reads.
    """

    name: str
    alternate: bool
    multipath: bool
    node_lock: bool
    balanced: bool


ABLATION = (
    Variant("baseline", alternate=False, multipath=False, node_lock=False, balanced=False),
    Variant("+order/cache", alternate=True, multipath=False, node_lock=False, balanced=False),
    Variant("+multi-path", alternate=True, multipath=True, node_lock=False, balanced=False),
    Variant("+concurrency control", alternate=True, multipath=True, node_lock=True, balanced=False),
    Variant("full", alternate=True, multipath=True, node_lock=True, balanced=True),
)


def _variant(
    variant: Variant,
    paths: Sequence[PathSpeed],
    *,
    num_records: int,
    record_bytes: float,
    cache_bytes: float,
    processes_per_node: int = 1,
    contention: float = 0.8,
    compute_seconds: float = 0.0,
    prefetch_depth: int = 1,
    write_depth: int = 0,
    write_back: bool = True,
) -> tuple[tuple[PathSpeed, ...], dict[str, Any]]:
    """The paths one ablation variant uses and the arguments of :func:`predict` it means.

    The baseline uses the first path with no cache; without ``balanced`` the split is equal (a fixed
    ratio, as in the paper) and nothing is prefetched in idle time; with it, the first
    ``prefetch_depth`` reads of the update are. In every variant the last ``write_depth`` writes run on
    past the update (the library's engine). ``write_back`` is as for :func:`predict`.
    """
    used = tuple(paths) if variant.multipath else tuple(paths[:1])
    return used, dict(
        num_records=num_records,
        record_bytes=record_bytes,
        cache_bytes=cache_bytes if variant.alternate else 0,
        alternate=variant.alternate,
        shares=None if variant.balanced else tuple(1 / len(used) for _ in used),
        compute_seconds=compute_seconds,
        processes_per_node=processes_per_node,
        contention=1.0 if variant.node_lock else contention,
        prefetch_records=prefetch_depth if variant.balanced else 0,
        write_back=write_back,
        run_on=write_depth,
    )


def predict_variant(
    variant: Variant, paths: Sequence[PathSpeed], *, idle_seconds: float = math.inf, **run: Any
) -> Prediction:
    """The update of one ablation variant (:func:`predict`), with ``idle_seconds`` between updates.

    ``run`` is the run's ``num_records``, ``record_bytes``, ``cache_bytes``, ``processes_per_node``,
    ``contention``, ``compute_seconds``, ``prefetch_depth``, ``write_depth`` and ``write_back``.
    """
    used, options = _variant(variant, paths, **run)
    return predict(used, idle_seconds=idle_seconds, **options)


def predict_variant_step(
    variant: Variant, paths: Sequence[PathSpeed], *, forward_backward_seconds: float, overlapped: bool, **run: Any
) -> float:
    """The step of one ablation variant (:func:`predict_step`), split or overlapped; ``run`` as for :func:`predict_variant`."""
    used, options = _variant(variant, paths, **run)
    return predict_step(used, forward_backward_seconds=forward_backward_seconds, overlapped=overlapped, **options)
