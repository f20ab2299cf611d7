"""Run identity and resume: what ``run.json`` says a path holds, and the last step complete everywhere.

``run.json`` is written on each path only once ``init`` has filled the tiers (or found a step to
resume at), so a path without it holds no run. With several ``jax.distributed`` processes, the
processes agree on the step to resume at.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import jax

from jax_mlp import peers
from jax_mlp.engine import Engine
from jax_mlp.errors import OffloadError, RecordError
from jax_mlp.partition import Plan
from jax_mlp.storage.paths import PathStore

RUN_FORMAT = 1


def run_identity(plan: Plan) -> dict:
    """What ``run.json`` records of a run: enough to refuse another run's directory."""
    return {
        "format": RUN_FORMAT,
        "layout_hash": plan.layout_hash.hex(),
        "num_subgroups": len(plan.subgroups),
        "state_bytes": plan.state_nbytes,
    }


def check_paths(paths: Sequence[PathStore], plan: Plan, *, resume: bool) -> None:
    """Refuses paths whose run does not fit ``resume``: a run where a fresh one is asked, another
    layout's run, or no run at all where ``resume`` is asked.

    Raises:
      OffloadError: a path holds a run but ``resume`` is False, or no path holds one but it is True.
      RecordError: a path holds a run of another layout.
    """
    expected = run_identity(plan)["layout_hash"]
    found = {path.root: path.read_run_file() for path in paths}
    for root, identity in found.items():
        if identity is not None and not resume:
            raise OffloadError(
                f"path {root} already holds offloaded optimizer state; pass resume=True to continue that run, "
                "or give an empty directory"
            )
        if identity is not None and identity.get("layout_hash") != expected:
            raise RecordError(
                f"path {root} holds state of another run or subgroup layout (layout hash "
                f"{identity.get('layout_hash')}, expected {expected}); resume with the same params, optimizer "
                "and subgroup_size, or give an empty directory"
            )
    if resume and not any(found.values()):
        raise OffloadError(
            f"resume=True, but no path in {list(found)} holds offloaded optimizer state; check the paths, "
            "or start a new run without resume"
        )


def last_complete_step(
    engine: Engine, paths: Sequence[PathStore], plan: Plan, *, run_key: str, peer_timeout: float
) -> tuple[int, dict[int, int]]:
    """The highest step at which every subgroup has a verified record on some path, and where each is.

    With several processes, the highest such step that every process has: a process that
    finished one more update than a dead peer resumes one step back, from its other slot.

    Args:
      engine: runs the scans of the subgroups' slots on its reader threads.
      paths: the storage paths.
      plan: the subgroups and their layout hash.
      run_key: names this offloader alike in every process, for the agreement.
      peer_timeout: seconds to wait for the other processes.

    Returns:
      The step, and the index of the path holding each subgroup's record of it.

    Raises:
      RecordError: no step is complete (and verified) everywhere.
    """
    found: dict[int, dict[int, int]] = {}

    def scan(index: int) -> dict[int, int]:
        steps = {}
        for path_index, path in enumerate(paths):
            for slot in (0, 1):
                step = path.verified_step(index, slot, plan.layout_hash)
                if step is not None:
                    steps[step] = path_index
        return steps

    engine.run(range(len(plan.subgroups)), scan, found.__setitem__, lambda *_: None)
    common = set.intersection(*(set(steps) for steps in found.values()))
    if jax.process_count() > 1:
        published = peers.all_values(f"{run_key}/resume", json.dumps(sorted(common)), peer_timeout, "resume")
        common = common.intersection(*(json.loads(value) for value in published))
    if not common:
        raise RecordError(
            f"no step has a complete, verified record of every subgroup on paths {[p.root for p in paths]}; "
            "the tiers cannot be resumed: restore from a checkpoint"
        )
    step = max(common)
    return step, {index: steps[step] for index, steps in found.items()}
