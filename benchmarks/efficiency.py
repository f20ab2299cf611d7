"""Pipeline efficiency: one offloaded update against the raw disk and against plain optax.

In one process, on the same file system and sizes, it measures

1. the raw bandwidth of the path: aligned ``os.pwrite`` and ``os.preadv``, as many bytes as one
   update reads (and writes), in two request shapes: whole records (``--threads`` in flight) and
   the offloader's chunk files (``CHUNKS_IN_FLIGHT`` in flight), writing, reading, and both at once.
   O_DIRECT is used where the file system allows it; otherwise buffered I/O with ``fsync`` and
   ``posix_fadvise(DONTNEED)``, and the JSON says which. One round runs before every update, so
   the disk is measured under the same conditions as the update;
2. the update time of ``mlp_offload(optax.adam, host_cache=0)`` on a state of ``--state`` bytes,
   with the page cache of every file under the path synced and dropped before each update, split
   into read wait, compute, write wait and Python overhead (from ``tx.stats``);
3. the I/O lower bound of that update, ``bytes_read / raw_read + bytes_written / raw_write``, and
   the ratio of the update to it (and to the bound from reading and writing at once);
4. plain in-memory optax adam (jitted update and apply) against ``mlp_offload`` with a host cache
   larger than the state and ``flush="lazy"``, update by update in turn, in wall and CPU seconds.

Writes ``efficiency.json`` and ``efficiency.png`` into ``--out``.

Only the public face is used. The record size is the init's bytes written over its records
(``tx.stats``: header included); the chunk files' size is read from the files the init wrote (zarr3
keeps a record's chunks under ``c/``); ``CHUNKS_IN_FLIGHT`` is the local backend's chunk requests per
direction (8, docs/efficiency.md; ``tests/test_benchmarks.py`` checks it against the library); the
record checksum is ISA-L's CRC-32, which records use (docs/usage.md).

    python benchmarks/efficiency.py --out benchmarks/results --before benchmarks/results/efficiency_before.json
    python benchmarks/efficiency.py --smoke --out /tmp/eff       # a few seconds, for tests
"""

from __future__ import annotations

import argparse
import concurrent.futures
import errno
import functools
import json
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import parse_with_smoke
from isal.isal_zlib import crc32 as records_crc32

import jax_mlp

ALIGN = 4096
CHUNKS_IN_FLIGHT = 8
"""Chunk files the offloader's local backend moves at once per direction and path (docs/efficiency.md)."""
BUFFERED = "buffered + fsync + posix_fadvise(DONTNEED)"
SMOKE = {"state": "8MiB", "subgroup_size": "1MiB", "leaf": "256KiB", "cached_state": "4MiB", "updates": 2}
LARGER_THAN_RAM = (
    "not run: on this CPU-only machine the JAX device is host RAM, so params, grads and the returned "
    "updates (each half the adam state) share the 23 GiB with everything else; a state larger than RAM "
    "(> 23 GiB, so > 11.5 GiB of fp32 params) would need > 34 GiB for those alone. No byte of the measured "
    "state comes from this machine's RAM anyway: host_cache=0, records are read and written with O_DIRECT, "
    "and the page cache of the path is dropped before every update, so the per-byte figures carry over."
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state", default="2GiB", help="adam state of the offloaded update (2x the fp32 params)")
    parser.add_argument("--subgroup-size", default="64MiB", help="subgroup_size of mlp_offload (one record)")
    parser.add_argument("--leaf", default="8MiB", help="bytes of each 2-D fp32 param leaf")
    parser.add_argument("--cached-state", default="512MiB", help="adam state of the optax vs cached comparison")
    parser.add_argument("--updates", type=int, default=5, help="measured updates (after one warm-up)")
    parser.add_argument("--threads", type=int, default=4, help="whole-record raw requests in flight, and max_inflight")
    defaults = jax_mlp.OffloadConfig("/unused")  # the library's own depths: the benchmark measures the defaults
    parser.add_argument("--prefetch-depth", type=int, default=defaults.prefetch_depth)
    parser.add_argument("--write-depth", type=int, default=defaults.write_depth)
    parser.add_argument("--before", default=None, help="an earlier efficiency.json to draw next to this run")
    parser.add_argument("--dir", default=None, help="the path under test (default: a temp dir inside --out)")
    parser.add_argument("--out", default="benchmarks/results", help="output folder for the JSON and PNG")
    return parse_with_smoke(parser, argv, SMOKE)


def make_params(state_bytes: int, leaf_bytes: int) -> dict:
    """Random fp32 params of 2-D leaves of ``leaf_bytes`` whose adam state (two moments) is ``state_bytes``.

    Random values keep the state incompressible, so no layer below can make its bytes cheaper.
    """
    columns = 256
    rows = max(1, leaf_bytes // (4 * columns))
    count = max(1, state_bytes // (8 * rows * columns))
    keys = jax.random.split(jax.random.key(0), count)
    return {f"w{i:04d}": jax.random.normal(keys[i], (rows, columns), jnp.float32) for i in range(count)}


def grads_like(params: dict, scale: float) -> dict:
    grads = jax.tree.map(lambda p: p * scale, params)
    return jax.block_until_ready(grads)


def tree_nbytes(tree: dict) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


# ----------------------------------------------------------------------------- raw bandwidth


def drop_page_cache(directory: str) -> None:
    """Syncs every file under ``directory`` and drops it from the page cache, so reads come from the disk."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def chunk_file_bytes(directory: str) -> int:
    """The size of the chunk files the offloader wrote under ``directory``: zarr3 keeps a record's chunks in ``c/``."""
    return max(
        os.path.getsize(os.path.join(root, name))
        for root, _, files in os.walk(directory)
        if os.path.basename(root) == "c"
        for name in files
    )


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned anonymous buffer, as O_DIRECT requires."""
    return mmap.mmap(-1, nbytes)


def open_raw(name: str, flags: int, direct: bool) -> int:
    return os.open(name, flags | (os.O_DIRECT if direct else 0), 0o644)


def supports_direct(directory: str) -> bool:
    """Whether files in ``directory`` can be opened with O_DIRECT (tmpfs and some others refuse)."""
    name = os.path.join(directory, ".direct_probe")
    try:
        os.close(open_raw(name, os.O_WRONLY | os.O_CREAT, True))
    except OSError as error:
        if error.errno == errno.EINVAL:
            return False
        raise
    finally:
        if os.path.exists(name):
            os.remove(name)
    return True


def write_file(name: str, buffer: mmap.mmap, direct: bool) -> None:
    """One request: pwrite the whole buffer; when buffered, fsync it and drop it from the page cache.

    With O_DIRECT the bytes are on the device when pwrite returns, as the offloader's are: no fsync.
    """
    fd = open_raw(name, os.O_WRONLY | os.O_CREAT, direct)
    try:
        view, offset = memoryview(buffer), 0
        while offset < len(view):
            offset += os.pwrite(fd, view[offset:], offset)
        if not direct:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_file(name: str, buffer: mmap.mmap, direct: bool) -> None:
    """One request: preadv the whole file into ``buffer``."""
    fd = open_raw(name, os.O_RDONLY, direct)
    try:
        view, offset = memoryview(buffer), 0
        while offset < len(view):
            got = os.preadv(fd, [view[offset:]], offset)
            if got == 0:
                raise OSError(errno.EIO, f"{name} is shorter than {len(view)} bytes")
            offset += got
    finally:
        os.close(fd)


def timed_map(function, items: list, threads: int) -> float:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(function, items))
    return time.perf_counter() - start


def timed_both(read, read_items: list, write, write_items: list, threads: int) -> float:
    """Seconds to read ``read_items`` and write ``write_items`` at once, ``threads`` in flight each."""
    start = time.perf_counter()
    with (
        concurrent.futures.ThreadPoolExecutor(threads) as readers,
        concurrent.futures.ThreadPoolExecutor(threads) as writers,
    ):
        futures = [readers.submit(read, name) for name in read_items] + [writers.submit(write, n) for n in write_items]
        for future in futures:
            future.result()
    return time.perf_counter() - start


class RawFiles:
    """Files of one request each under ``directory``, written from one aligned buffer and read into
    one aligned buffer per thread."""

    def __init__(self, directory: str, request: int, direct: bool):
        os.makedirs(directory, exist_ok=True)
        self.directory, self.request, self.direct = directory, request, direct
        self.source = aligned_buffer(request)
        np.frombuffer(self.source, np.uint8)[:] = np.random.default_rng(0).integers(0, 256, request, dtype=np.uint8)
        self._per_thread = threading.local()

    def names(self, prefix: str, count: int) -> list[str]:
        return [os.path.join(self.directory, f"{prefix}{k:05d}") for k in range(count)]

    def write(self, name: str) -> None:
        write_file(name, self.source, self.direct)

    def read(self, name: str) -> None:
        if not hasattr(self._per_thread, "buffer"):
            self._per_thread.buffer = aligned_buffer(self.request)
        read_file(name, self._per_thread.buffer, self.direct)


class RawShape:
    """One request shape of the raw benchmark: ``total_bytes`` as files of ``request_bytes``,
    ``threads`` requests in flight (each way when reading and writing at once)."""

    def __init__(self, directory: str, total_bytes: int, request_bytes: int, threads: int, direct: bool):
        self.files = RawFiles(directory, -(-request_bytes // ALIGN) * ALIGN, direct)
        self.count = max(1, round(total_bytes / self.files.request))
        self.old, self.new = self.files.names("a", self.count), self.files.names("b", self.count)
        self.threads = threads
        self.rounds: dict[str, list[float]] = {"read": [], "write": [], "both": []}

    def round(self) -> None:
        """Writes every file, reads it back, then reads it while writing as many new ones; the page
        cache of every file is dropped between phases (O_DIRECT leaves nothing there anyway)."""
        files, directory = self.files, self.files.directory
        self.rounds["write"].append(timed_map(files.write, self.old, self.threads))
        drop_page_cache(directory)
        self.rounds["read"].append(timed_map(files.read, self.old, self.threads))
        self.rounds["both"].append(timed_both(files.read, self.old, files.write, self.new, self.threads) / 2)
        drop_page_cache(directory)

    def summary(self) -> dict:
        """Medians in bytes/s over the rounds after the first (which creates the files), and every
        round; ``both`` counts the bytes read plus the bytes written."""
        nbytes = self.count * self.files.request
        figures = {"request_bytes": self.files.request, "requests": self.count, "threads": self.threads}
        for kind, seconds in self.rounds.items():
            figures[f"{kind}_bytes_per_s"] = nbytes / statistics.median(seconds[1:] or seconds)
            figures[f"{kind}_bytes_per_s_rounds"] = [nbytes / s for s in seconds]
        return figures


class RawDisk:
    """The raw path, measured in rounds between the updates: whole-record requests, and chunk-sized
    requests as many in flight as the offloader's chunk pools."""

    def __init__(self, directory: str, total_bytes: int, record_bytes: int, chunk_bytes: int, threads: int):
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.direct = supports_direct(directory)
        self.shapes = {
            "records": RawShape(directory, total_bytes, record_bytes, threads, self.direct),
            "chunks": RawShape(directory, total_bytes, chunk_bytes, CHUNKS_IN_FLIGHT, self.direct),
        }

    def round(self) -> None:
        for shape in self.shapes.values():
            shape.round()

    def summary(self) -> dict:
        """Each figure from the faster shape, so that the bounds made of them are the lowest."""
        shapes = {name: shape.summary() for name, shape in self.shapes.items()}
        best = {
            f"{kind}_bytes_per_s": max(shape[f"{kind}_bytes_per_s"] for shape in shapes.values())
            for kind in ("read", "write", "both")
        }
        return {"mode": "O_DIRECT" if self.direct else BUFFERED, **best, "shapes": shapes}

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


# ----------------------------------------------------------------------------- offloaded update


def sync_and_drop(directory: str) -> float:
    """Flushes every file under ``directory`` to the disk and drops it from the page cache; returns seconds."""
    start = time.perf_counter()
    drop_page_cache(directory)
    return time.perf_counter() - start


def split_of(stats: jax_mlp.UpdateStats) -> dict:
    """The update's wall time split as ``tx.stats`` gives it, plus what none of them covers."""
    overhead = stats.seconds - (stats.read_wait_s + stats.compute_s + stats.write_wait_s)
    return {
        "seconds": stats.seconds,
        "read_wait_s": stats.read_wait_s,
        "compute_s": stats.compute_s,
        "write_wait_s": stats.write_wait_s,
        "python_overhead_s": overhead,
        "bytes_read": sum(stats.bytes_read.values()),
        "bytes_written": sum(stats.bytes_written.values()),
        "cache_hits": stats.cache_hits,
    }


def median_split(splits: list[dict]) -> dict:
    return {key: statistics.median(s[key] for s in splits) for key in splits[0]}


def offloaded_update(args: argparse.Namespace, root: str, params: dict) -> tuple[dict, dict]:
    """Median time and split of ``--updates`` uncached updates, each after a round of the raw
    benchmark on the same file system and the page cache of the path dropped.

    Returns:
      The update's figures and the raw disk's.
    """
    directory = os.path.join(root, "update")
    tx = jax_mlp.mlp_offload(
        optax.adam(1e-3),
        paths=[directory],
        host_cache=0,
        subgroup_size=args.subgroup_size,
        prefetch_depth=args.prefetch_depth,
        write_depth=args.write_depth,
        max_inflight=args.threads,
        idle_prefetch=False,
    )
    state = tx.init(params)
    plan = tx.plan
    stored = sum(tx.stats.bytes_written.values())  # the init writes every record once: headers and payloads
    record_bytes = stored // len(plan.subgroups)
    raw = RawDisk(os.path.join(root, "raw"), stored, record_bytes, chunk_file_bytes(directory), args.threads)
    splits, walls, syncs = [], [], []
    try:
        for step in range(args.updates + 1):
            grads = grads_like(params, 0.1 * (step + 1))
            raw.round()
            syncs.append(sync_and_drop(directory))
            start = time.perf_counter()
            updates, state = tx.update(grads, state, params)
            jax.block_until_ready(updates)
            walls.append(time.perf_counter() - start)
            splits.append(split_of(tx.stats))
            del updates, grads
        syncs.append(sync_and_drop(directory))
    finally:
        tx.close(delete=True)
        raw.remove()
    update = {
        "state_bytes": plan.state_nbytes,
        "records": len(plan.subgroups),
        "record_bytes": record_bytes,
        "options": {
            "host_cache": 0,
            "subgroup_size": args.subgroup_size,
            "prefetch_depth": args.prefetch_depth,
            "write_depth": args.write_depth,
            "max_inflight": args.threads,
            "idle_prefetch": False,
        },
        "page_cache": "before each update every file under the path is fsynced and posix_fadvise(DONTNEED)ed",
        "warmup": splits[0],
        "updates": splits[1:],
        "wall_s": walls[1:],
        "write_sync_s": syncs[2:],
        "median": median_split(splits[1:]),
    }
    return update, raw.summary()


def io_bound(update: dict, raw: dict) -> dict:
    """The update's I/O lower bound from the raw figures, and its ratio to the update.

    ``bound_s`` assumes one disk serves reads and writes one after the other; ``concurrent_bound_s``
    uses the raw rate of reading and writing at once, as the update does, which a disk with
    parallel queues serves at a rate of its own.
    """
    median = update["median"]
    read_s = median["bytes_read"] / raw["read_bytes_per_s"]
    write_s = median["bytes_written"] / raw["write_bytes_per_s"]
    bound = read_s + write_s
    concurrent = (median["bytes_read"] + median["bytes_written"]) / raw["both_bytes_per_s"]
    return {
        "read_s": read_s,
        "write_s": write_s,
        "bound_s": bound,
        "concurrent_bound_s": concurrent,
        "update_median_s": median["seconds"],
        "ratio": median["seconds"] / bound,
        "ratio_to_concurrent_bound": median["seconds"] / concurrent,
        "ratio_with_write_sync": (median["seconds"] + statistics.median(update["write_sync_s"])) / bound,
        "target_ratio": 1.25,
    }


# ----------------------------------------------------------------------------- cached vs optax


def timed(run) -> tuple[float, float]:
    """Wall seconds of ``run()``, and the CPU seconds of all this process's threads meanwhile."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


class PlainOptax:
    """Jitted optax adam update and apply, the in-memory reference. Nothing is donated: on CPU,
    donating state and params made the step three times slower here."""

    def __init__(self, params: dict):
        inner = optax.adam(1e-3)

        def step(grads, state, params):
            updates, state = inner.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        self._step = jax.jit(step)
        self.params, self.state = jax.tree.map(jnp.copy, params), inner.init(params)

    def __call__(self, grads: dict) -> None:
        self.params, self.state = jax.block_until_ready(self._step(grads, self.state, self.params))


class CachedOffload:
    """``mlp_offload`` whose host cache holds the whole state: ``update`` then a jitted apply, or the
    fused ``apply`` (which consumes the grads it is given)."""

    def __init__(self, args: argparse.Namespace, directory: str, params: dict, *, fused: bool = False):
        self.options = {"host_cache": 4 * tree_nbytes(params), "flush": "lazy"}
        self.tx = jax_mlp.mlp_offload(
            optax.adam(1e-3),
            paths=[directory],
            subgroup_size=args.subgroup_size,
            prefetch_depth=args.prefetch_depth,
            write_depth=args.write_depth,
            **self.options,
        )
        self.fused = fused
        self._apply = jax.jit(optax.apply_updates)
        self.params, self.state = jax.tree.map(jnp.copy, params), self.tx.init(params)

    def __call__(self, grads: dict) -> None:
        if self.fused:
            self.params, self.state = self.tx.apply(grads, self.state, self.params)
            jax.block_until_ready(self.params)
            return
        updates, self.state = self.tx.update(grads, self.state, self.params)
        self.params = jax.block_until_ready(self._apply(self.params, updates))


def cached_vs_optax(args: argparse.Namespace, directory: str) -> dict:
    """Plain optax and mlp_offload with the whole state cached (``update`` + apply, and the fused
    ``apply``), update by update in turn.

    Wall times are noisy on a shared 2-core machine; CPU seconds (all threads) say what each costs.
    """
    params = make_params(jax_mlp.parse_size(args.cached_state), jax_mlp.parse_size(args.leaf))
    runners = {
        "optax": PlainOptax(params),
        "offload": CachedOffload(args, os.path.join(directory, "update"), params),
        "fused": CachedOffload(args, os.path.join(directory, "apply"), params, fused=True),  # last: it frees grads
    }
    wall: dict[str, list[float]] = {name: [] for name in runners}
    cpu: dict[str, list[float]] = {name: [] for name in runners}
    splits = []
    try:
        for index in range(3 * args.updates + 2):
            grads = grads_like(params, 0.1 * (index + 1))
            for name, runner in runners.items():
                seconds, cpu_seconds = timed(functools.partial(runner, grads))
                wall[name].append(seconds)
                cpu[name].append(cpu_seconds)
            splits.append(split_of(runners["offload"].tx.stats))
            del grads
    finally:
        runners["offload"].tx.close(delete=True)
        runners["fused"].tx.close(delete=True)
    median = {name: statistics.median(times[2:]) for name, times in wall.items()}
    median_cpu = {name: statistics.median(times[2:]) for name, times in cpu.items()}
    return {
        "state_bytes": 2 * tree_nbytes(params),
        "offload_options": runners["offload"].options,
        "optax_s": wall["optax"][2:],
        "offload_s": wall["offload"][2:],
        "fused_s": wall["fused"][2:],
        "offload_splits": splits[2:],
        "optax_median_s": median["optax"],
        "offload_median_s": median["offload"],
        "fused_median_s": median["fused"],
        "ratio": median["offload"] / median["optax"],
        "fused_ratio": median["fused"] / median["optax"],
        "optax_median_cpu_s": median_cpu["optax"],
        "offload_median_cpu_s": median_cpu["offload"],
        "fused_median_cpu_s": median_cpu["fused"],
        "cpu_ratio": median_cpu["offload"] / median_cpu["optax"],
        "fused_cpu_ratio": median_cpu["fused"] / median_cpu["optax"],
        "target_ratio": 1.5,
        "fused_target_ratio": 1.10,
    }


# ----------------------------------------------------------------------------- output


SPLIT_PARTS = {
    "read_wait_s": "tab:blue",
    "compute_s": "tab:green",
    "write_wait_s": "tab:orange",
    "python_overhead_s": "tab:grey",
}


def draw_raw(axis, raw: dict) -> None:
    """Read, write and both-at-once bandwidth of each request shape."""
    kinds = ("read", "write", "both")
    for offset, (name, shape) in zip((-0.2, 0.2), raw["shapes"].items(), strict=True):
        speeds = [shape[f"{kind}_bytes_per_s"] / 1e9 for kind in kinds]
        label = f"{name}: {shape['request_bytes'] / 2**20:.1f} MiB x {shape['threads']}"
        axis.bar([i + offset for i in range(len(kinds))], speeds, 0.4, label=label)
    axis.set_xticks(range(len(kinds)), ["read", "write", "read + write at once"])
    axis.set_ylabel("GB/s")
    axis.set_title(f"raw disk ({raw['mode'].split(' ')[0]}), median of rounds")
    axis.legend(fontsize=8)


def draw_split(axis, result: dict, before: dict | None) -> None:
    """The uncached update's split (medians of each part), before and after, next to the bounds."""
    splits = ([("before", before["update"]["median"])] if before else []) + [("after", result["update"]["median"])]
    for position, (_, split) in enumerate(splits):
        bottom = 0.0
        for part, colour in SPLIT_PARTS.items():
            axis.bar(position, split[part], 0.6, bottom=bottom, color=colour, label=None if position else part)
            bottom += split[part]
    bound = result["bound"]
    bounds = {"I/O bound": bound["bound_s"], "concurrent bound": bound["concurrent_bound_s"]}
    axis.bar(range(len(splits), len(splits) + 2), list(bounds.values()), 0.6, color="black", alpha=0.4)
    axis.set_xticks(range(len(splits) + 2), [name for name, _ in splits] + list(bounds))
    axis.set_ylabel("seconds")
    axis.set_title(f"uncached update: {bound['ratio']:.2f}x the I/O bound")
    axis.legend(fontsize=8)


def draw_cached(axis, result: dict, before: dict | None) -> None:
    """Plain optax against the cached offloader, after (and before) the changes."""
    cached = result["cached_vs_optax"]
    bars = {"optax": cached["optax_median_s"]}
    if before:
        bars["offload before"] = before["cached_vs_optax"]["offload_median_s"]
    bars["offload"] = cached["offload_median_s"]
    if "fused_median_s" in cached:
        bars["fused apply"] = cached["fused_median_s"]
    axis.bar(list(bars), list(bars.values()), color=["tab:blue"] + ["tab:orange"] * (len(bars) - 1))
    axis.set_ylabel("seconds")
    axis.set_title(f"state in RAM: offload / optax = {cached['ratio']:.2f}")


def plot(result: dict, before: dict | None, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (raw_axis, split_axis, cached_axis) = plt.subplots(1, 3, figsize=(15, 4.5))
    draw_raw(raw_axis, result["raw"])
    draw_split(split_axis, result, before)
    draw_cached(cached_axis, result, before)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def checksum_speed(nbytes: int) -> dict:
    """Bytes/s of the record checksum (ISA-L's CRC-32, what records use), and of zlib's, on ``nbytes`` of random data."""
    data = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    speeds = {}
    for name, crc in (("used", records_crc32), ("zlib", zlib.crc32)):
        seconds = min(timed(functools.partial(crc, data))[0] for _ in range(3))
        speeds[f"{name}_bytes_per_s"] = nbytes / seconds
    return {"used": records_crc32.__module__, **speeds}


def report(result: dict) -> None:
    raw, bound, cached = result["raw"], result["bound"], result["cached_vs_optax"]
    median = result["update"]["median"]
    print(
        f"raw ({raw['mode']}): read {raw['read_bytes_per_s'] / 1e9:.2f} GB/s, "
        f"write {raw['write_bytes_per_s'] / 1e9:.2f} GB/s, both at once {raw['both_bytes_per_s'] / 1e9:.2f} GB/s"
    )
    print(
        f"update {median['seconds']:.3f} s (read wait {median['read_wait_s']:.3f}, compute {median['compute_s']:.3f}, "
        f"write wait {median['write_wait_s']:.3f}, overhead {median['python_overhead_s']:.3f}); "
        f"bound {bound['bound_s']:.3f} s, ratio {bound['ratio']:.2f}; concurrent bound "
        f"{bound['concurrent_bound_s']:.3f} s, ratio {bound['ratio_to_concurrent_bound']:.2f}"
    )
    print(
        f"cached offload {cached['offload_median_s']:.3f} s vs optax {cached['optax_median_s']:.3f} s: "
        f"ratio {cached['ratio']:.2f} (CPU seconds: {cached['cpu_ratio']:.2f}); fused apply "
        f"{cached['fused_median_s']:.3f} s: ratio {cached['fused_ratio']:.2f} (CPU seconds: {cached['fused_cpu_ratio']:.2f})"
    )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    root = args.dir or tempfile.mkdtemp(prefix=".efficiency-", dir=args.out)
    state_bytes = jax_mlp.parse_size(args.state)
    try:
        params = make_params(state_bytes, jax_mlp.parse_size(args.leaf))
        update, raw = offloaded_update(args, root, params)
        del params
        result = {
            "devices": [str(d) for d in jax.devices()],
            "cpus": os.cpu_count(),
            "path": os.path.abspath(root),
            "raw": raw,
            "update": update,
            "bound": io_bound(update, raw),
            "cached_vs_optax": cached_vs_optax(args, os.path.join(root, "cached")),
            "checksum": checksum_speed(update["record_bytes"]),
            "larger_than_ram": {"run": False, "why": LARGER_THAN_RAM},
        }
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    before = None
    if args.before:
        with open(args.before) as f:
            before = json.load(f)
    with open(os.path.join(args.out, "efficiency.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot(result, before, os.path.join(args.out, "efficiency.png"))
    report(result)
    return result


if __name__ == "__main__":
    main()
