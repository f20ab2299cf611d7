"""Run identity and resume: what ``run.json`` says a path holds, and the last step complete everywhere.

``run.json`` is written on each path only once ``init`` has filled the tiers (or found a step to
resume at), so a path without it holds no run. Beside the layout hash it describes the plan
(leaves, master dtype, subgroup size, each record's state fields), so a path of another layout is
refused naming what changed. With several ``jax.distributed`` processes, the processes agree on the
step to resume at.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import jax
import numpy as np

from jax_mlp._src import peers, state_codecs
from jax_mlp._src.errors import OffloadError, RecordError
from jax_mlp._src.plan.partition import LeafOrder, Plan, treedef_paths
from jax_mlp._src.storage.paths import PathStore
from jax_mlp._src.storage.record import RecordLayout
from jax_mlp._src.stream.engine import Engine
from jax_mlp._src.stream.state_stream import StateStream

RUN_FORMAT = 1

Intent = Literal["init", "resume", "restore"]
"""What ``init`` is asked to do with the paths: start a run, continue the one they hold, or restore a checkpoint."""


def describe_plan(plan: Plan, subgroup_size: int) -> dict[str, Any]:
    """A readable description of ``plan``, as JSON gives it back: what a layout hash stands for.

    It lists each param leaf (path, shape, dtype), the master dtype, the subgroup size and each
    record's state fields (path in the optimizer state, shape, dtype), so two plans can be compared
    field by field and the first difference named.
    """
    description = {
        "leaves": [[leaf.path, list(leaf.shape), str(leaf.dtype)] for leaf in plan.leaves],
        "master_dtype": None if plan.master_dtype is None else str(plan.master_dtype),
        "master_storage": _master_storage(plan),
        "subgroup_size": subgroup_size,
        "leaf_order": plan.leaf_order,
        "state_fields": [
            [
                [name, list(field.shape), str(field.dtype)]
                for name, field in zip(treedef_paths(sg.layout.state_treedef), sg.layout.state_fields, strict=True)
            ]
            for sg in plan.subgroups
        ],
    }
    return json.loads(json.dumps(description))


def _master_storage(plan: Plan) -> str | None:
    """How the plan's records hold masters: ``"remainder"`` if any as int16 remainders, else ``"full"``."""
    if plan.master_dtype is None:
        return None
    remainder = any(f.dtype == np.int16 for sg in plan.subgroups for f in sg.layout.master_fields)
    return "remainder" if remainder else "full"


def run_identity(plan: Plan, subgroup_size: int) -> dict:
    """What ``run.json`` records of a run: enough to refuse another run's directory and say what differs."""
    return {
        "format": RUN_FORMAT,
        "int8_format": state_codecs.INT8_FORMAT,
        "layout_hash": plan.layout_hash.hex(),
        "num_subgroups": len(plan.subgroups),
        "state_bytes": plan.state_nbytes,
        "plan": describe_plan(plan, subgroup_size),
    }


def _spec(entry: list) -> str:
    """A described leaf or field as ``path dtype[shape]``."""
    name, shape, dtype = entry
    return f"{name} {dtype}{shape}"


def _first_difference(held: dict, wanted: dict) -> str | None:
    """The first difference between the plan described in a ``run.json`` and the one asked for, in words."""
    for index, (there, here) in enumerate(zip(held["leaves"], wanted["leaves"], strict=False)):
        if there != here:
            return f"param leaf {index} is {_spec(there)} there, {_spec(here)} here"
    if len(held["leaves"]) != len(wanted["leaves"]):
        return f"it has {len(held['leaves'])} param leaves, these params {len(wanted['leaves'])}"
    for key in ("master_dtype", "subgroup_size"):
        if held[key] != wanted[key]:
            return f"its {key} is {held[key]}, this offload's {wanted[key]}"
    # A run.json written before remainders existed describes full masters.
    storage = held.get("master_storage", None if held["master_dtype"] is None else "full")
    if storage != wanted["master_storage"]:
        return (
            f"its records hold {storage} masters, this offload's {wanted['master_storage']} ones: pass "
            f"master_storage={storage!r} to resume it"
        )
    order = held.get("leaf_order", "tree")  # a run.json written before 0.3 describes tree order
    if order != wanted["leaf_order"]:
        return f"its leaves are packed into subgroups in {order} order, this offload's in {wanted['leaf_order']} order"
    cause = "another optimizer or sharding"
    for index, (there, here) in enumerate(zip(held["state_fields"], wanted["state_fields"], strict=False)):
        for field, (a, b) in enumerate(zip(there, here, strict=False)):
            if a != b:
                return f"subgroup {index}'s state field {field} is {_spec(a)} there, {_spec(b)} here ({cause})"
        if len(there) != len(here):
            return f"subgroup {index} holds {len(there)} state fields there, {len(here)} here ({cause})"
    if len(held["state_fields"]) != len(wanted["state_fields"]):
        return f"it has {len(held['state_fields'])} subgroups, this plan {len(wanted['state_fields'])}"
    return None


def _what_differs(identity: dict, plan: Plan, subgroup_size: int) -> str:
    """Why a path's run is not this plan's: its first difference, or the hashes where ``run.json`` has no plan."""
    held = identity.get("plan")
    difference = None if held is None else _first_difference(held, describe_plan(plan, subgroup_size))
    if difference is None:  # a run.json of an older version, or a change only the hash sees (the sharding)
        return f"layout hash {identity.get('layout_hash')}, expected {plan.layout_hash.hex()}"
    return difference


def held_leaf_order(paths: Sequence[PathStore]) -> LeafOrder:
    """The order the run on ``paths`` packed its leaves in: ``"tree"`` for a run planned before 0.3, whose
    ``run.json`` does not say; ``"natural"`` where no path holds a run."""
    for path in paths:
        identity = path.read_run_file()
        if identity is not None:
            return identity.get("plan", {}).get("leaf_order", "tree")
    return "natural"


def newest_step(paths: Sequence[PathStore], plan: Plan) -> int | None:
    """The step of the newest verified record of subgroup 0 on ``paths``: what the tiers hold, read cheaply.

    The last step complete on every subgroup is this one or the one before (a crash inside an update).
    """
    steps = [path.verified_step(0, slot, plan.layout_hash) for path in paths for slot in (0, 1)]
    return max((step for step in steps if step is not None), default=None)


def check_paths(paths: Sequence[PathStore], plan: Plan, subgroup_size: int, *, intent: Intent) -> None:
    """Refuses paths whose run does not fit ``intent``; for a restore onto this run's paths, discards it.

    A path may hold this run (same layout hash) only to resume it or to restore a checkpoint over
    it; the restore replaces its state with a warning naming the step it held. A path holding
    another layout's run is refused, naming the first difference.

    Raises:
      OffloadError: a path holds this run but ``intent`` is a fresh ``init``, or no path holds one
        but ``intent`` is to resume.
      RecordError: a path holds a run of another layout.
    """
    expected = plan.layout_hash.hex()
    found = {path.root: path.read_run_file() for path in paths}
    for root, identity in found.items():
        if identity is None:
            continue
        if identity.get("layout_hash") != expected:
            remedy = (
                "resume with the params, optimizer, subgroup_size and master_dtype of that run, or start a new run "
                "(without resume) on an empty directory"
                if intent == "resume"
                else f"give an empty directory, or delete {root} if that run's state is not needed"
            )
            differs = _what_differs(identity, plan, subgroup_size)
            raise RecordError(f"path {root} holds state of another run or subgroup layout ({differs}); {remedy}")
        if intent == "resume":
            _check_int8_format(root, identity, plan)
        if intent == "init":
            step = newest_step(paths, plan)
            held = "" if step is None else f" (its newest record is of step {step})"
            raise OffloadError(
                f"path {root} already holds this run's offloaded optimizer state{held}; pass resume=True to continue "
                "from the tiers at their last complete step, or restore a checkpoint onto these paths "
                "(jax_mlp.OffloadRestore), which replaces that state; or give an empty directory"
            )
    if intent == "resume" and not any(found.values()):
        raise OffloadError(
            f"resume=True, but no path in {list(found)} holds offloaded optimizer state; check the paths, "
            "or start a new run without resume"
        )
    if intent == "restore" and any(found.values()):
        _discard(paths, plan, [root for root, identity in found.items() if identity is not None])


def _check_int8_format(root: str, identity: dict, plan: Plan) -> None:
    """Refuses to resume records whose uint8 state fields (int8 codes) are of another codec format.

    A ``run.json`` without ``int8_format`` was written with format 1 (the dynamic map): its codes have the
    same shapes, so the layout hash cannot tell them apart.
    """
    held = identity.get("int8_format", 1)
    coded = any(
        any(state_codecs.int8_codes(jax.tree_util.tree_unflatten(sg.layout.state_treedef, _structs(sg.layout))))
        for sg in plan.subgroups
    )
    if coded and held != state_codecs.INT8_FORMAT:
        raise OffloadError(
            f"path {root} holds a run whose int8 state codes are of format {held}, and this version reads format "
            f"{state_codecs.INT8_FORMAT} only (block floating point): resume that run with the jax_mlp version that "
            "wrote it, or start a new run (without resume) on an empty directory, restoring the params alone"
        )


def _structs(layout: RecordLayout) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(field.shape, field.dtype) for field in layout.state_fields]


def _discard(paths: Sequence[PathStore], plan: Plan, held: list[str]) -> None:
    """Deletes the records this run left on ``paths``, warning with the step they held, before a restore.

    Left in the other slot, an old record of a later step would pass every check and could be
    resumed beside the restored ones; ``run.json`` stays until the restore rewrites it.
    """
    step = newest_step(paths, plan)
    warnings.warn(
        f"restoring a checkpoint onto paths {held}, which hold this run's offloaded state"
        f"{'' if step is None else f' up to step {step}'}: that state is discarded and replaced by the checkpoint's",
        stacklevel=2,
    )
    for path in paths:
        for index in range(len(plan.subgroups)):
            path.delete(index)


def last_complete_step(
    engine: Engine,
    paths: Sequence[PathStore],
    plan: Plan,
    *,
    peer_key: str,
    peer_timeout: float,
    num_records: int | None = None,
) -> tuple[int, dict[int, int]]:
    """The highest step at which every record has a verified copy on some path, and where each is.

    With several processes, the highest such step that every process has: a process that
    finished one more update than a dead peer resumes one step back, from its other slot.

    Args:
      engine: runs the scans of the subgroups' slots on its reader threads.
      paths: the storage paths.
      plan: the subgroups and their layout hash.
      peer_key: names this offloader alike in every process, for the agreement.
      peer_timeout: seconds to wait for the other processes.
      num_records: the records to scan: one per subgroup (the default), or with a layer-streamed plan's
        params records after them.

    Returns:
      The step, and the index of the path holding each record of it.

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

    records = len(plan.subgroups) if num_records is None else num_records
    engine.pipeline(range(records), scan, found.__setitem__, lambda *_: None)
    common = set.intersection(*(set(steps) for steps in found.values()))
    if jax.process_count() > 1:
        published = peers.all_values(f"{peer_key}/resume", json.dumps(sorted(common)), peer_timeout, "resume")
        common = common.intersection(*(json.loads(value) for value in published))
    if not common:
        raise RecordError(
            f"no step has a complete, verified record of every subgroup on paths {[p.root for p in paths]}; "
            "the tiers cannot be resumed: restore from a checkpoint"
        )
    step = max(common)
    return step, {index: steps[step] for index, steps in found.items()}


def resume_at(stream: StateStream, *, peer_key: str, records: int | None = None) -> None:
    """Takes the tiers up at the last step complete on every path (and, with several processes, in every one),
    over the first ``records`` records (by default all: those a step commits)."""
    config = stream.config
    step, locations = last_complete_step(
        stream.engine,
        stream.tiers.paths,
        stream.plan,
        peer_key=peer_key,
        peer_timeout=config.peer_timeout,
        num_records=len(stream.record_bytes) if records is None else records,
    )
    stream.resume_at(step, locations)
