"""The pipeline: reads ahead on reader threads, computes on the caller's thread, stages, writes behind.

The engine is policy-free: it is handed an order and three or four callables and knows nothing of
optax, records or paths. A computed value may hold device memory that its write would hold for the
write's whole length; a ``stage`` callable turns it into what the write needs (the host copy) on one
stager thread, one or two values at a time, so the writes trail behind holding host memory only.
Every error raised on any thread reaches the caller of :meth:`Engine.pipeline`, and every wait is
bounded by ``io_timeout``, so a failure never hangs.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

from jax_mlp._src.errors import OffloadError


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
      io_timeout: seconds a single read, staging or store may take before it counts as hung.
    """

    def __init__(self, prefetch_depth: int, write_depth: int, io_timeout: float):
        self.prefetch_depth = prefetch_depth
        self.write_depth = write_depth
        self.io_timeout = io_timeout
        self._readers = concurrent.futures.ThreadPoolExecutor(prefetch_depth, thread_name_prefix="jax_mlp-read")
        self._stager = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jax_mlp-stage")
        self._writers = concurrent.futures.ThreadPoolExecutor(write_depth, thread_name_prefix="jax_mlp-write")
        self._background: list[tuple[str, concurrent.futures.Future]] = []  # (what it does, the work)

    def result(self, future: concurrent.futures.Future, what: str) -> Any:
        """The future's result, waiting at most ``io_timeout``; ``what`` names it in the error."""
        try:
            return future.result(timeout=self.io_timeout)
        except concurrent.futures.TimeoutError:
            raise _hung(what, self.io_timeout) from None

    def settle(self, futures: Iterable[concurrent.futures.Future]) -> None:
        """Cancels what has not started and waits (bounded) for the rest, ignoring their errors."""
        futures = list(futures)
        for future in futures:
            future.cancel()
        concurrent.futures.wait(futures, timeout=self.io_timeout)

    def pipeline(
        self,
        order: Iterable[int],
        fetch: Callable[[int], Any],
        compute: Callable[[int, Any], Any],
        store: Callable[[int, Any], None],
        describe: Callable[[int], str] = "subgroup {}".format,
        run_on: int = 0,
        stage: Callable[[int, Any], Any] | None = None,
    ) -> Timings:
        """Runs ``store(k, stage(k, compute(k, fetch(k))))`` for each ``k`` in ``order``, pipelined.

        ``fetch`` runs on reader threads up to ``prefetch_depth`` ahead, ``compute`` on this thread
        in order, ``stage`` (if given) on the stager thread in order, and ``store`` on writer threads
        with at most ``write_depth`` in flight. A computed value is dropped once staged, and each waits
        for the one before it to be staged, so at most two are held at once, whatever ``write_depth``:
        the newest, and the one before it while it stages (what a computed value holds, device memory,
        is never held for a write's length). The stagings have finished when ``pipeline`` returns, and
        the stores too, but for those of the last ``run_on`` keys, which run on as background work
        (:meth:`wait_background`). ``describe(k)`` names ``k`` (and where it lives) in a timeout's message.

        Returns:
          The time spent waiting on reads, computing, and waiting on stagings and writes.

        Raises:
          The first exception raised by any of the callables, after the others have settled.
        """
        start = time.perf_counter()
        read_wait = compute_time = write_wait = 0.0
        reads = _ReadQueue(self._readers, fetch, order, self.prefetch_depth)
        stagings: collections.deque[tuple[int, concurrent.futures.Future]] = collections.deque()
        writes: collections.deque[tuple[int, concurrent.futures.Future]] = collections.deque()
        try:
            for key, future in reads:
                t0 = time.perf_counter()
                fetched = self.result(future, f"reading {describe(key)}")
                del future  # it holds the fetched fields too, which must go with ``fetched``
                t1 = time.perf_counter()
                computed = compute(key, fetched)
                del fetched
                t2 = time.perf_counter()
                if stage is None:
                    self._write(writes, store, key, computed, describe)
                else:
                    stagings.append((key, self._stager.submit(_letting_go(stage, key, computed))))
                del computed  # its store or staging holds it now; a staging lets go of it as it returns
                self._write_staged(stagings, 1, writes, store, describe)
                read_wait += t1 - t0
                compute_time += t2 - t1
                write_wait += time.perf_counter() - t2
            t3 = time.perf_counter()
            self._write_staged(stagings, 0, writes, store, describe)
            self._drain(writes, run_on, describe)
            write_wait += time.perf_counter() - t3
        except BaseException:
            self.settle([f for _, f in reads.pending] + [f for _, f in stagings] + [f for _, f in writes])
            raise
        self._background.extend((f"storing {describe(key)}", future) for key, future in writes)
        return Timings(time.perf_counter() - start, read_wait, compute_time, write_wait)

    def _write_staged(
        self,
        stagings: collections.deque,
        keep: int,
        writes: collections.deque,
        store: Callable[[int, Any], None],
        describe: Callable[[int], str],
    ) -> None:
        """Waits for the oldest stagings until at most ``keep`` are in flight, and hands each to :meth:`_write`."""
        while len(stagings) > keep:
            key, future = stagings.popleft()
            staged = self.result(future, f"staging {describe(key)}")
            del future  # it holds the staged value too, which the write alone must hold
            self._write(writes, store, key, staged, describe)

    def _write(
        self,
        writes: collections.deque,
        store: Callable[[int, Any], None],
        key: int,
        value: Any,
        describe: Callable[[int], str],
    ) -> None:
        """Starts ``store(key, value)`` on a writer thread once fewer than ``write_depth`` stores are in flight."""
        self._drain(writes, self.write_depth - 1, describe)
        writes.append((key, self._writers.submit(store, key, value)))

    def _drain(self, writes: collections.deque, keep: int, describe: Callable[[int], str]) -> None:
        """Waits for the oldest stores until at most ``keep`` are in flight."""
        while len(writes) > keep:
            key, future = writes.popleft()
            self.result(future, f"storing {describe(key)}")

    def read_ahead(self, fetch: Callable[[int], Any], key: int) -> concurrent.futures.Future:
        """Runs ``fetch(key)`` on a reader thread now, for a later :meth:`pipeline` to collect (idle-time reads)."""
        return self._readers.submit(fetch, key)

    def write_behind(self, store: Callable[[int, Any], None], key: int, value: Any) -> None:
        """Runs ``store(key, value)`` on a writer thread after the current pipeline (idle-time writes)."""
        self._background.append((f"writing back cached subgroup {key}", self._writers.submit(store, key, value)))

    def background_done(self) -> bool:
        """Whether the background work has finished (its errors are raised by :meth:`wait_background`)."""
        return all(future.done() for _, future in self._background)

    def wait_background(self) -> float:
        """Waits for background work; re-raises its first error. Returns the seconds waited."""
        start = time.perf_counter()
        background, self._background = self._background, []
        try:
            for what, future in background:
                self.result(future, what)
        except BaseException:
            self.settle(future for _, future in background)
            raise
        return time.perf_counter() - start

    def settle_background(self) -> None:
        """Cancels or waits out the background work, ignoring its errors (the step it wrote is given up)."""
        background, self._background = self._background, []
        self.settle(future for _, future in background)

    def close(self) -> None:
        """Stops the threads; work not yet started is dropped."""
        self._readers.shutdown(wait=False, cancel_futures=True)
        self._stager.shutdown(wait=False, cancel_futures=True)
        self._writers.shutdown(wait=False, cancel_futures=True)


class _ReadQueue:
    """The reads of one run in order, submitted up to ``depth`` ahead of the one being consumed."""

    def __init__(self, readers: Any, fetch: Callable[[int], Any], order: Iterable[int], depth: int):
        self._readers, self._fetch, self._depth = readers, fetch, depth
        self._order = iter(order)
        self.pending: collections.deque[tuple[int, concurrent.futures.Future]] = collections.deque()
        self._top_up()

    def _top_up(self) -> None:
        while len(self.pending) < self._depth:
            key = next(self._order, None)
            if key is None:
                return
            self.pending.append((key, self._readers.submit(self._fetch, key)))

    def __iter__(self) -> Iterator[tuple[int, concurrent.futures.Future]]:
        while self.pending:
            item = self.pending.popleft()
            self._top_up()
            yield item


class ReadAhead:
    """Reads started before a run, for the run's fetches to take: futures by key, behind a lock.

    Reader threads take from it while the caller may still add or settle, so it is the one owner
    of those futures.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._futures: dict[int, concurrent.futures.Future] = {}

    def add(self, key: int, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._futures[key] = future

    def take(self, key: int) -> concurrent.futures.Future | None:
        """The read of ``key`` started ahead, now owned by the caller, or None."""
        with self._lock:
            return self._futures.pop(key, None)

    def keys(self) -> tuple[int, ...]:
        """The keys read ahead and not yet taken, in the order they were started."""
        with self._lock:
            return tuple(self._futures)

    def take_all(self) -> list[concurrent.futures.Future]:
        """Every read not yet taken (to settle them)."""
        with self._lock:
            futures, self._futures = list(self._futures.values()), {}
            return futures


def _letting_go(stage: Callable[[int, Any], Any], key: int, value: Any) -> Callable[[], Any]:
    """``stage(key, value)`` as a call that holds ``value`` only until ``stage`` takes it.

    An executor's work item keeps its arguments until after it has set the future's result, so the
    caller could see a value staged while the stager thread still held it; this call's own reference
    goes as ``stage`` starts, so it is gone by the time ``stage`` returns.
    """
    held = [value]
    return lambda: stage(key, held.pop())


def _hung(what: str, timeout: float) -> OffloadError:
    """The error of a wait that outlasted ``io_timeout``; ``what`` names what was waited for."""
    return OffloadError(
        f"{what} did not finish within io_timeout={timeout:g}s; the storage path may be hung: "
        "check its device or mount, or raise io_timeout for a slow path"
    )
