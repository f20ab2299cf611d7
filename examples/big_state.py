"""Train a model whose optimizer state is larger than the host cache, and watch host memory.

The model is a deep stack of square ``tanh`` layers with bfloat16 params; the optimizer is AdamW
with an fp32 master copy of the params (``master_dtype=jnp.float32``), the usual mixed-precision
setup. Its state is 12 bytes per parameter (master, first and second moment), six times the
params. ``--state`` sets its size; the default, about 1 GiB behind a host cache of a quarter of
it, runs in under a minute on 2 CPU cores. Larger values (``--state 64GiB --host-cache 8GiB``) go
beyond the RAM of the machine: the state is never in RAM, only the cache and a few subgroups in
flight. (On a CPU backend the params, grads and updates must fit in RAM: the script checks.) The
first update compiles the subgroup updates, which takes memory for a moment, so the peak of the
later updates is reported on its own.

The script prints the peak resident set size (RSS) of the process against the size of the state.
On an accelerator the params, grads and updates live in device memory. On a CPU backend the device
*is* host RAM, so they are counted in the RSS too: the script samples the RSS during ``init`` and
the updates, and reports what the offloaded optimizer added to the RSS it found before ``init``
(Python, jax, params, grads), less the updates it returns, which plain optax would allocate too.

On Linux, glibc's malloc keeps freed buffers of up to 32 MiB in per-thread arenas instead of
returning them, and the offloader frees a few such buffers per subgroup; the RSS then grows far
beyond the cache. The script therefore sets glibc's mmap threshold to 1 MiB (``mallopt``, the same
as ``MALLOC_MMAP_THRESHOLD_=1048576``), so large buffers go back to the system when freed; pass
``--malloc-mmap-threshold 0`` to keep glibc's default and see the difference.

Run it with::

    python examples/big_state.py
    python examples/big_state.py --state 4GiB --host-cache 1GiB --paths /nvme/run /pfs/run
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import shutil
import sys
import threading
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import psutil
from offload_options import state_paths

import jax_mlp

STATE_BYTES_PER_PARAM = 12  # fp32 master, mu and nu
BATCH = 8


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


class RssSampler:
    """Samples the process's resident set size every millisecond on a thread, while in a ``with``."""

    def __init__(self):
        self._process = psutil.Process()
        self._running = False
        self.peak = 0

    def now(self) -> int:
        return self._process.memory_info().rss

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, self.now())
            time.sleep(0.001)

    def __enter__(self) -> RssSampler:
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, self.now())


def set_malloc_mmap_threshold(nbytes: int) -> bool:
    """Makes glibc serve (and return) every allocation of at least ``nbytes`` with mmap; False if not glibc."""
    if nbytes <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, nbytes))
    except (OSError, AttributeError):
        return False


def make_params(num_layers: int, width: int, seed: int) -> dict[str, jax.Array]:
    """``num_layers`` bfloat16 ``width × width`` matrices, made on the device one at a time."""
    keys = jax.random.split(jax.random.key(seed), num_layers)
    init = jax.jit(lambda k: (jax.random.normal(k, (width, width)) / np.sqrt(width)).astype(jnp.bfloat16))
    return {f"layer{i:03d}": init(k) for i, k in enumerate(keys)}


def loss(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """A deep tanh network asked to map its input to zero: every layer gets a gradient."""
    h = x
    for name in sorted(params):
        h = jnp.tanh(h @ params[name].astype(jnp.float32))
    return jnp.mean(h**2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--state", default="1GiB", help="target size of the AdamW state (master, mu, nu)")
    parser.add_argument(
        "--host-cache", default=None, help="host RAM that may hold state records (default: a quarter of the state)"
    )
    parser.add_argument("--subgroup-size", default="4MiB", help="bytes of state streamed at a time")
    parser.add_argument("--width", type=int, default=4096, help="width of each square layer")
    parser.add_argument("--steps", type=int, default=4, help="training steps")
    parser.add_argument(
        "--paths",
        nargs="+",
        default=None,
        help="directories for the state (new or empty). Default: a temporary directory, removed at the end",
    )
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    parser.add_argument(
        "--malloc-mmap-threshold",
        default="1MiB",
        help="on Linux, make glibc return freed buffers of at least this size to the system; 0 keeps its default",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the params and the data")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.width < 1:
        parser.error("--steps and --width must be at least 1")
    return args


def _check_room(num_params: int, state_bytes: int, paths: list[str]) -> None:
    """Refuses sizes this machine cannot hold, before anything is allocated or written."""
    device_bytes = num_params * (2 + 2 + 4)  # bf16 params and grads, fp32 updates
    if jax.default_backend() == "cpu":
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if device_bytes > 0.8 * available:
            raise SystemExit(
                f"on a CPU backend the params, grads and updates ({jax_mlp.format_bytes(device_bytes)}) live in host RAM, "
                f"and only {jax_mlp.format_bytes(available)} is free: choose a smaller --state, or run on an accelerator"
            )
    for path in paths:
        probe = path
        while not os.path.exists(probe):
            probe = os.path.dirname(probe) or "."
        free = shutil.disk_usage(probe).free
        if 2 * state_bytes > free:  # two slots per record: step t stays intact while t+1 is written
            raise SystemExit(
                f"{path} has {jax_mlp.format_bytes(free)} free; the state needs up to {jax_mlp.format_bytes(2 * state_bytes)} "
                "(two slots per record): give more --paths or a smaller --state"
            )


class Sizes(NamedTuple):
    """The model and the cache that ``--state``, ``--width`` and ``--host-cache`` ask for."""

    num_layers: int
    num_params: int
    host_cache: int


def sizes_of(args: argparse.Namespace) -> Sizes:
    """As many layers as come closest to ``--state`` (at least one); the cache defaults to a quarter of the state."""
    target = jax_mlp.parse_size(args.state, name="--state")
    num_layers = max(1, round(target / (STATE_BYTES_PER_PARAM * args.width**2)))
    num_params = num_layers * args.width**2
    host_cache = jax_mlp.parse_size(args.host_cache or STATE_BYTES_PER_PARAM * num_params // 4, name="--host-cache")
    return Sizes(num_layers, num_params, host_cache)


class Measured(NamedTuple):
    """What a run measured: the RSS before ``init`` and the peaks around the offloader's calls, the losses."""

    rss_before: int
    warmup_peak: int  # init and the first update, which compiles
    peak: int  # the later updates; the warm-up's with one step
    losses: list[float]
    state_nbytes: int
    stats: jax_mlp.UpdateStats


def train(args: argparse.Namespace, sizes: Sizes, paths: list[str], *, temporary: bool, tuned: bool) -> Measured:
    """Trains ``--steps`` steps with the AdamW state on ``paths``, sampling the RSS during the offloader's calls.

    Only those calls are sampled: forward and backward have their own peaks. The first update compiles
    (XLA's compiler takes memory for a moment), so it counts to the warm-up; later ones are steady.
    """
    params = make_params(sizes.num_layers, args.width, args.seed)
    grad_fn = jax.jit(jax.value_and_grad(loss))
    apply = jax.jit(optax.apply_updates, donate_argnums=0)
    data_key = jax.random.key(args.seed + 1)
    value, grads = grad_fn(params, jax.random.normal(data_key, (BATCH, args.width)))
    jax.block_until_ready(grads)
    gc.collect()
    warmup, steady = RssSampler(), RssSampler()
    rss_before = steady.now()

    offload = make_offload(args, paths, sizes.host_cache)
    losses = [float(value)]
    try:
        with warmup:
            state = offload.init(params)
        print_setup(args, sizes, offload.plan, len(paths), tuned=tuned)
        for step in range(args.steps):
            with warmup if step == 0 else steady:
                updates, state = offload.update(grads, state, params)
                jax.block_until_ready(updates)
            grads = None  # freed before the next grads are computed
            params = apply(params, updates)
            del updates
            value, grads = grad_fn(params, jax.random.normal(jax.random.fold_in(data_key, step), (BATCH, args.width)))
            losses.append(float(value))
            print(
                f"step {step + 1}: loss {losses[-1]:.5f}, update {offload.stats.seconds:.2f} s, "
                f"peak RSS {jax_mlp.format_bytes((warmup if step == 0 else steady).peak)}"
            )
        plan = offload.plan
        return Measured(rss_before, warmup.peak, steady.peak or warmup.peak, losses, plan.state_nbytes, offload.stats)
    finally:
        offload.close(delete=temporary)


def make_offload(args: argparse.Namespace, paths: list[str], host_cache: int) -> jax_mlp.OffloadTransformation:
    """AdamW with an fp32 master copy of the bf16 params, offloaded to ``paths``."""
    return jax_mlp.mlp_offload(
        optax.adamw(args.lr, weight_decay=0.0),
        paths=paths,
        host_cache=host_cache,
        subgroup_size=args.subgroup_size,
        master_dtype=jnp.float32,  # stored whole (12 B of state per param), as this example's sizes assume
    )


def print_setup(args: argparse.Namespace, sizes: Sizes, plan: jax_mlp.Plan, num_paths: int, *, tuned: bool) -> None:
    """Prints the model, the state and where it lives, and whether glibc's mmap threshold was set."""
    print(
        f"{sizes.num_layers} layers of {args.width}×{args.width}: {sizes.num_params:,} bfloat16 params "
        f"({jax_mlp.format_bytes(2 * sizes.num_params)}); AdamW state with fp32 master {jax_mlp.format_bytes(plan.state_nbytes)} "
        f"in {len(plan.subgroups)} subgroups on {num_paths} path(s), host cache {jax_mlp.format_bytes(sizes.host_cache)}; "
        f"glibc mmap threshold {args.malloc_mmap_threshold if tuned else 'left at its default'}"
    )


def report(measured: Measured, sizes: Sizes) -> dict[str, Any]:
    """Prints the RSS against the state and the cache, and the last update's stats; returns the figures."""
    state_bytes, host_cache = measured.state_nbytes, sizes.host_cache
    updates_bytes = 4 * sizes.num_params  # fp32, the master dtype
    offloader_rss = measured.peak - measured.rss_before - updates_bytes
    print()
    print(
        f"optimizer state            {jax_mlp.format_bytes(state_bytes):>10}  ({state_bytes / host_cache:.1f}× the host cache)"
    )
    print(
        f"RSS before init            {jax_mlp.format_bytes(measured.rss_before):>10}  (Python, jax, params and grads)"
    )
    print(
        f"peak RSS, init + update 1  {jax_mlp.format_bytes(measured.warmup_peak):>10}  (includes compiling the subgroup updates)"
    )
    print(
        f"peak RSS, later updates    {jax_mlp.format_bytes(measured.peak):>10}  ({measured.peak / state_bytes:.2f}× the state)"
    )
    print(
        f"  updates                  {jax_mlp.format_bytes(updates_bytes):>10}  (returned by update, as with plain optax)"
    )
    print(
        f"  offloader                {jax_mlp.format_bytes(offloader_rss):>10}  ({offloader_rss / state_bytes:.2f}× the state; "
        f"the host cache is {host_cache / state_bytes:.2f}×)"
    )
    print(measured.stats.summary())
    return {
        "state_bytes": state_bytes,
        "host_cache": host_cache,
        "updates_bytes": updates_bytes,
        "rss_before": measured.rss_before,
        "warmup_peak_rss": measured.warmup_peak,
        "peak_rss": measured.peak,
        "offloader_rss": offloader_rss,
        "losses": measured.losses,
        "stats": measured.stats.as_dict(),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Trains the big-state model and measures host memory during ``init`` and the updates.

    Args:
      argv: the command-line arguments; None reads ``sys.argv``.

    Returns:
      ``state_bytes``, ``host_cache``, ``updates_bytes``, ``rss_before`` (RSS before ``init``),
      ``warmup_peak_rss`` (highest RSS sampled during ``init`` and the first update, which
      compiles), ``peak_rss`` (highest during the later updates; the warm-up's with one step),
      ``offloader_rss`` (``peak_rss - rss_before - updates_bytes``), ``losses`` and ``stats``
      (the last update's ``UpdateStats.as_dict()``).
    """
    args = parse_args(argv)
    tuned = set_malloc_mmap_threshold(jax_mlp.parse_size(args.malloc_mmap_threshold, name="--malloc-mmap-threshold"))
    sizes = sizes_of(args)
    with state_paths(args.paths, count=1, prefix="jax_mlp_big_") as (paths, temporary):
        _check_room(sizes.num_params, sizes.num_params * STATE_BYTES_PER_PARAM, paths)
        measured = train(args, sizes, paths, temporary=temporary, tuned=tuned)
    return report(measured, sizes)


if __name__ == "__main__":
    main()
