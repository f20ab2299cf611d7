"""Telemetry: what one update moved and where its time went, in a form that is easy to log."""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import jax

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = threading.local()


def _count_compile(event: str, duration_secs: float, **_: Any) -> None:
    if event == _BACKEND_COMPILE_EVENT:
        _compiles.count = compiles_on_this_thread() + 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def compiles_on_this_thread() -> int:
    """XLA compilations run on the calling thread so far (jit caches hits are not counted)."""
    return getattr(_compiles, "count", 0)


class UpdateStats(NamedTuple):
    """Statistics of one ``update`` (or of ``init``, at step 0).

    Attributes:
      step: the step the update produced.
      seconds: wall time of the whole call.
      read_wait_s: time the pipeline waited for records to arrive.
      compute_s: time spent dispatching the jitted inner updates; dispatch is asynchronous, so the
        device time mostly shows in ``write_wait_s``, where writer threads wait for the results.
      write_wait_s: time the pipeline waited for records to be stored.
      bytes_read: bytes read from each path, keyed by path.
      bytes_written: bytes written to each path, keyed by path.
      cache_hits: subgroups served by the host cache.
      cache_misses: subgroups read from a path.
      compiles: XLA compilations this call triggered.
      total_compiles: XLA compilations all calls of this offloader triggered so far.
    """

    step: int
    seconds: float
    read_wait_s: float
    compute_s: float
    write_wait_s: float
    bytes_read: dict[str, int]
    bytes_written: dict[str, int]
    cache_hits: int
    cache_misses: int
    compiles: int
    total_compiles: int

    def as_dict(self) -> dict[str, Any]:
        """A flat, JSON-ready dict, with ``bytes_read[<path>]`` style keys for per-path figures."""
        flat: dict[str, Any] = {k: v for k, v in self._asdict().items() if not isinstance(v, dict)}
        for name in ("bytes_read", "bytes_written"):
            for path, nbytes in getattr(self, name).items():
                flat[f"{name}[{path}]"] = nbytes
        return flat


class IOCounters:
    """Thread-safe counters of bytes per path and cache hits, since the last ``reset``."""

    def __init__(self, paths: list[str]):
        self._paths = paths
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.bytes_read = dict.fromkeys(self._paths, 0)
            self.bytes_written = dict.fromkeys(self._paths, 0)
            self.cache_hits = 0
            self.cache_misses = 0

    def read(self, path: str, nbytes: int) -> None:
        with self._lock:
            self.bytes_read[path] += nbytes
            self.cache_misses += 1

    def wrote(self, path: str, nbytes: int) -> None:
        with self._lock:
            self.bytes_written[path] += nbytes

    def hit(self) -> None:
        with self._lock:
            self.cache_hits += 1
