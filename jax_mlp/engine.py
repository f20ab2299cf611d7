"""The pipeline: reads ahead on reader threads, computes on the caller's thread, writes behind.

The engine is policy-free: it is handed an order and three callables and knows nothing of optax,
records or paths. Every error raised on any thread reaches the caller of :meth:`Engine.run`, and
every wait is bounded by ``io_timeout``, so a failure never hangs.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from jax_mlp.errors import OffloadError


class Timings(NamedTuple):
    """Where one pipeline run spent its wall time, in seconds."""

    total: float
    read_wait: float
    compute: float
    write_wait: float


class Engine:
    """Thread pools and bounded queues that stream subgroups through a computation.

    Args:
      prefetch_depth: subgroups read ahead of the one being computed (reader threads).
      write_depth: computed subgroups whose stores may be in flight at once (writer threads).
      io_timeout: seconds a single read or store may take before it counts as hung.
    """

    def __init__(self, prefetch_depth: int, write_depth: int, io_timeout: float):
        self.prefetch_depth = prefetch_depth
        self.write_depth = write_depth
        self.io_timeout = io_timeout
        self._readers = concurrent.futures.ThreadPoolExecutor(prefetch_depth, thread_name_prefix="jax_mlp-read")
        self._writers = concurrent.futures.ThreadPoolExecutor(write_depth, thread_name_prefix="jax_mlp-write")
        self._background: list[concurrent.futures.Future] = []

    def result(self, future: concurrent.futures.Future, what: str) -> Any:
        """The future's result, waiting at most ``io_timeout``; ``what`` names it in the error."""
        try:
            return future.result(timeout=self.io_timeout)
        except concurrent.futures.TimeoutError:
            raise OffloadError(
                f"{what} did not finish within io_timeout={self.io_timeout:g}s; the storage path may be hung"
            ) from None

    def settle(self, futures: Iterable[concurrent.futures.Future]) -> None:
        """Cancels what has not started and waits (bounded) for the rest, ignoring their errors."""
        futures = list(futures)
        for future in futures:
            future.cancel()
        concurrent.futures.wait(futures, timeout=self.io_timeout)

    def run(
        self,
        order: Iterable[int],
        fetch: Callable[[int], Any],
        compute: Callable[[int, Any], Any],
        store: Callable[[int, Any], None],
    ) -> Timings:
        """Runs ``store(k, compute(k, fetch(k)))`` for each ``k`` in ``order``, pipelined.

        ``fetch`` runs on reader threads up to ``prefetch_depth`` ahead, ``compute`` on this thread
        in order, and ``store`` on writer threads with at most ``write_depth`` in flight. All stores
        have finished when ``run`` returns.

        Returns:
          The time spent waiting on reads, computing, and waiting on writes.

        Raises:
          The first exception raised by any of the callables, after the others have settled.
        """
        start = time.perf_counter()
        read_wait = compute_time = write_wait = 0.0
        pending = iter(order)
        reads: collections.deque[tuple[int, concurrent.futures.Future]] = collections.deque()
        writes: collections.deque[tuple[int, concurrent.futures.Future]] = collections.deque()

        def read_ahead() -> None:
            while len(reads) < self.prefetch_depth:
                key = next(pending, None)
                if key is None:
                    return
                reads.append((key, self._readers.submit(fetch, key)))

        try:
            read_ahead()
            while reads:
                key, future = reads.popleft()
                read_ahead()
                t0 = time.perf_counter()
                fetched = self.result(future, f"reading subgroup {key}")
                t1 = time.perf_counter()
                computed = compute(key, fetched)
                del fetched
                t2 = time.perf_counter()
                while len(writes) >= self.write_depth:
                    done_key, done = writes.popleft()
                    self.result(done, f"storing subgroup {done_key}")
                t3 = time.perf_counter()
                writes.append((key, self._writers.submit(store, key, computed)))
                del computed
                read_wait += t1 - t0
                compute_time += t2 - t1
                write_wait += t3 - t2
            t4 = time.perf_counter()
            while writes:
                done_key, done = writes.popleft()
                self.result(done, f"storing subgroup {done_key}")
            write_wait += time.perf_counter() - t4
        except BaseException:
            self.settle([f for _, f in reads] + [f for _, f in writes])
            raise
        return Timings(time.perf_counter() - start, read_wait, compute_time, write_wait)

    def read_ahead(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Runs ``fn(*args)`` on a reader thread now, for a later :meth:`run` to collect."""
        return self._readers.submit(fn, *args)

    def submit_background(self, fn: Callable[..., None], *args: Any) -> None:
        """Runs ``fn(*args)`` on a writer thread after the current update (idle-time I/O)."""
        self._background.append(self._writers.submit(fn, *args))

    def background_done(self) -> bool:
        """Whether the background work has finished (its errors are raised by :meth:`wait_background`)."""
        return all(future.done() for future in self._background)

    def wait_background(self) -> float:
        """Waits for background work; re-raises its first error. Returns the seconds waited."""
        start = time.perf_counter()
        background, self._background = self._background, []
        try:
            for future in background:
                self.result(future, "writing back a cached subgroup")
        except BaseException:
            self.settle(background)
            raise
        return time.perf_counter() - start

    def close(self) -> None:
        """Stops the threads; work not yet started is dropped."""
        self._readers.shutdown(wait=False, cancel_futures=True)
        self._writers.shutdown(wait=False, cancel_futures=True)
