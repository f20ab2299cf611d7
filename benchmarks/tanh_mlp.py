"""The model the step benchmarks train, as users write it, and what they measure beside it.

Tanh layers of one width in a dict ``l0``, ``l1``, ... (flattening sorts those keys as strings), their
loss, the batch whose forward and backward take a given time, a timed training loop, the steps of the
library's first trial of the overlap (``TRIAL``), and the peak RSS of a block of code.
"""

from __future__ import annotations

import math
import statistics
import threading
import time

import jax
import jax.numpy as jnp
import optax
import psutil

import jax_mlp

TRIAL = 9
"""Steps of ``overlap_mode="timed"``'s first trial: 0-1 untimed, 2-4 overlapped, 5 untimed, 6-8 split."""


def make_params(layers: int, width: int, dtype=jnp.float32) -> dict:
    """The layers' weights: a dict of ``l0``, ``l1``, ... of ``width`` × ``width``."""
    keys = jax.random.split(jax.random.PRNGKey(0), layers)
    return {
        f"l{i}": (jax.random.normal(k, (width, width)) / math.sqrt(width)).astype(dtype) for i, k in enumerate(keys)
    }


def loss(params: dict, x: jax.Array) -> jax.Array:
    """The mean square of the last layer's output, computed in float32."""
    for i in range(len(params)):
        x = jnp.tanh(x @ params[f"l{i}"].astype(jnp.float32))
    return jnp.mean(x**2)


def batch(params: dict, rows: int) -> jax.Array:
    """A batch of ``rows`` inputs for ``params``."""
    return jnp.ones((rows, params["l0"].shape[0]))


def forward_backward_seconds(params: dict, rows: int) -> float:
    """The median time of a jitted forward and backward with a batch of ``rows``."""
    grad = jax.jit(jax.grad(loss))
    x = batch(params, rows)
    jax.block_until_ready(grad(params, x))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(grad(params, x))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rows_for(params: dict, target: float) -> int:
    """The batch whose forward and backward take about ``target`` seconds (linear in the rows)."""
    per_row = forward_backward_seconds(params, 256) / 256
    return max(8, round(target / per_row))


def timed_steps(
    tx: optax.GradientTransformation, offload: jax_mlp.OffloadTransformation, grads_of, params: dict, x, steps: int
) -> tuple[list[float], list[jax_mlp.UpdateStats]]:
    """Initialises ``tx`` (which holds ``offload``) and trains ``steps`` steps of ``grads_of(params, x)``: each
    whole step's seconds (grads, update, apply) and ``offload``'s stats after it."""
    seconds, stats = [], []
    state = tx.init(params)
    for _ in range(steps):
        start = time.perf_counter()
        updates, state = tx.update(grads_of(params, x), state, params)
        params = jax.block_until_ready(optax.apply_updates(params, updates))
        seconds.append(time.perf_counter() - start)
        stats.append(offload.stats)
    return seconds, stats


class PeakRss:
    """The peak resident memory while in a ``with``, sampled every millisecond."""

    def __enter__(self) -> PeakRss:
        self.peak, self._done = 0, threading.Event()
        process = psutil.Process()

        def sample() -> None:
            while not self._done.is_set():
                self.peak = max(self.peak, process.memory_info().rss)
                time.sleep(0.001)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._done.set()
        self._thread.join()
