"""Room on the paths: what a path's share of the records takes on disk, what it has free, and the check at init.

A path holds two slots of every record placed on it (step ``s`` in slot ``s % 2``). On a file
system a slot is its chunk files, each rounded up to whole blocks, plus a ``zarr.json`` and two
directories of a block each. ``HEADROOM`` more covers what that count leaves out: ``run.json`` and
the lock file, the file system's own metadata, and a rebalancing that moves a few records here.

The check runs when ``init`` (or a restore) is about to write the first record. Bytes the run
directory already takes count as free, since its records are rewritten in place; paths on one file
system share its free space. A path whose backend reports no free space (a kvstore) is not checked.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence

from jax_mlp._src.errors import PathError
from jax_mlp._src.parsing import format_bytes
from jax_mlp._src.storage.backend import Room
from jax_mlp._src.storage.buffers import round_up
from jax_mlp._src.storage.paths import PathStore
from jax_mlp._src.storage.record import chunk_bytes

HEADROOM = 0.05
"""Extra room asked for beyond two slots of a path's records, as a fraction of them."""
BLOCK = 4096
"""The block size assumed where no file system is at hand (``jax-mlp plan``)."""
_METADATA_BLOCKS = 3  # a slot's zarr.json, its directory and its chunk directory


def slot_bytes(record_nbytes: int, block: int = BLOCK) -> int:
    """Bytes one slot of a record of ``record_nbytes`` takes on a file system of ``block``-byte blocks."""
    chunk = chunk_bytes(record_nbytes)
    return -(-record_nbytes // chunk) * round_up(chunk, block) + _METADATA_BLOCKS * block


def need(record_bytes: Iterable[int], block: int = BLOCK) -> int:
    """Bytes a path needs for two slots of each record in ``record_bytes`` (their sizes), plus ``HEADROOM``."""
    return math.ceil(2 * sum(slot_bytes(nbytes, block) for nbytes in record_bytes) * (1 + HEADROOM))


def held_bytes(directory: str) -> int:
    """The bytes the records in a run directory already take (its subdirectories; not the run and lock files)."""
    held = 0
    for root, _, files in os.walk(directory):
        if root == directory:
            continue
        for name in files:
            try:
                held += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                continue  # removed while we walked
    return held


def check_capacity(paths: Sequence[PathStore], record_bytes: Sequence[int], placement: Sequence[int]) -> None:
    """Refuses, before anything is written, a file system without room for its paths' shares.

    Args:
      paths: the opened paths.
      record_bytes: each subgroup's record size.
      placement: the index of the path each subgroup's records go to.

    Raises:
      PathError: naming the path (or the paths on one file system), what they need and what is free.
    """
    by_device: dict[int, list[tuple[PathStore, Room, int, int]]] = {}
    for index, path in enumerate(paths):
        space = path.backend.room()
        if space is None:
            continue
        records = [nbytes for nbytes, at in zip(record_bytes, placement, strict=True) if at == index]
        by_device.setdefault(space.device, []).append((path, space, need(records, space.block), len(records)))
    for group in by_device.values():
        needed = sum(n for _, _, n, _ in group)
        held = sum(held_bytes(path.directory) for path, _, _, _ in group)  # a path with room is a directory here
        free = group[0][1].free
        if needed > free + held:
            raise PathError(_shortage(group, needed, free, held))


def _shortage(group: list[tuple[PathStore, Room, int, int]], needed: int, free: int, held: int) -> str:
    has = format_bytes(free) + (f" (plus {format_bytes(held)} of its records, rewritten in place)" if held else "")
    remedy = (
        f"two slots of each record plus {HEADROOM:.0%} headroom; free space there, give another path (or more "
        f"paths, to share the records), or give {'this path' if len(group) == 1 else 'one of them'} a smaller "
        "share: declare a lower read_bandwidth and write_bandwidth for it with jax_mlp.Path"
    )
    if len(group) == 1:
        path, _, _, count = group[0]
        return (
            f"path {path.root} has {has} free, but its share of {count} records needs {format_bytes(needed)}: {remedy}"
        )
    shares = ", ".join(f"{path.root}: {format_bytes(n)} for {count} records" for path, _, n, count in group)
    return f"paths {shares} share one file system, which has {has} free, but they need {format_bytes(needed)}: {remedy}"
