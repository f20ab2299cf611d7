"""The rise of resident memory over a block of code, for the memory tests' child processes."""

from __future__ import annotations

import threading
import time

import jax
import psutil


class PeakRise:
    """Samples RSS every millisecond on a thread while in a ``with``; ``rise`` is the peak minus
    the RSS at entry. Each block gets its own sampler, so no sample of an earlier block leaks in."""

    def __init__(self):
        self._process = psutil.Process()
        self._done = threading.Event()
        self.rise = 0

    def _sample(self, before: int) -> None:
        while not self._done.is_set():
            self.rise = max(self.rise, self._process.memory_info().rss - before)
            time.sleep(0.001)

    def __enter__(self) -> PeakRise:
        time.sleep(0.05)  # let memory freed just before settle
        self._thread = threading.Thread(target=self._sample, args=(self._process.memory_info().rss,), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        time.sleep(0.01)
        self._done.set()
        self._thread.join()


def update_rises(tx, params, steps: int = 3) -> list[int]:
    """The RSS rise of each of ``steps`` eager updates of ``tx`` from ``tx.init(params)``, grads made beforehand."""
    state = tx.init(params)
    rises = []
    for step in range(steps):
        grads = jax.tree.map(lambda p, step=step: p * 0.01 + step, params)
        jax.block_until_ready(grads)
        with PeakRise() as peak:
            updates, state = tx.update(grads, state, params)
            jax.block_until_ready(updates)
        rises.append(peak.rise)
        del updates, grads
    return rises
