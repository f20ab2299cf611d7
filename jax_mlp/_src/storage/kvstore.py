"""The kvstore backend: a path given as a tensorstore kvstore spec or URL (S3, GCS, memory, ...).

Records live under ``<spec path>proc{process_index}/``, and the run file is a key there. tensorstore
moves the bytes: each record's ~4 MiB chunks are requests of their own, many in flight at once (up to
the driver's ``*_request_concurrency``, 32 by default), which is what an object store needs in place of
O_DIRECT. A spec is opened in one tensorstore context of its own, so a ``memory`` store lives as long
as its backend, and a failing request is retried with exponential backoff for at most
``store_timeout`` seconds (:func:`retries_within`) before it fails with an error naming the store;
the records' other requests then in flight give up at once (:class:`_Request`), so an update on an
unreachable store fails after about ``store_timeout``, not one such wait after another.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorstore as ts

from jax_mlp._src.errors import PathError
from jax_mlp._src.parsing import kvstore_url
from jax_mlp._src.storage.backend import RUN_FILE, RecordArray, open_zarr3, zarr3_spec

FIRST_RETRY_DELAY = 0.1
"""Seconds before the first retry of a failed request (tensorstore's default is 1 s)."""
LONGEST_RETRY_DELAY = 8.0
"""The longest wait between two retries (tensorstore's default is 32 s)."""
_STORE_FAULTS = ("PERMISSION_DENIED", "UNAUTHENTICATED", "ABORTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "CURL error")
_REFUSED = ("PERMISSION_DENIED", "UNAUTHENTICATED", "InvalidAccessKeyId", "SignatureDoesNotMatch")
_HTTP_DETAIL = re.compile(r"\s*\[http_response_body=.*", re.DOTALL)
OUTAGE_POLL = 0.05
"""Seconds between a waiting request's looks at whether another one found the store unreachable."""


def retries_within(seconds: float) -> dict:
    """tensorstore's retry settings (``s3_request_retries``, ``gcs_request_retries``) whose backoff adds up to at most ``seconds``.

    tensorstore waits ``initial_delay * 2**attempt`` plus a jitter of up to ``initial_delay``, at most
    ``max_delay``, before each retry; its defaults (32 retries, 1 s to 32 s) add up to about 15 minutes.

    Args:
      seconds: the longest total wait (``store_timeout``).

    Returns:
      The settings as a JSON object, at least one retry.
    """
    first = min(FIRST_RETRY_DELAY, seconds / 2)
    longest = max(first, min(LONGEST_RETRY_DELAY, seconds / 4))
    total, count = 0.0, 0
    while True:
        delay = min(first * 2**count + first, longest)
        if count and total + delay > seconds:
            break
        total, count = total + delay, count + 1
    return {"max_retries": count, "initial_delay": f"{first:g}s", "max_delay": f"{longest:g}s"}


ONE_RETRY = {"max_retries": 1, "initial_delay": "0.01s", "max_delay": "0.01s"}
"""The fewest retries tensorstore allows: whether a store answers now."""


def store_context(retries: dict) -> ts.Context:
    """A tensorstore context whose object-store requests are retried as ``retries`` says (see :func:`retries_within`)."""
    return ts.Context({"file_io_sync": False, "s3_request_retries": retries, "gcs_request_retries": retries})


def with_credentials(spec: dict) -> dict:
    """``spec``, with S3 credentials read from the environment where ``AWS_ACCESS_KEY_ID`` is set and it names none.

    tensorstore's ``default`` chain also reads ``~/.aws`` and logs four errors on every open where those
    files are missing; keys in the environment need none of it. A spec's own ``aws_credentials`` wins.
    """
    if spec["driver"] == "s3" and "aws_credentials" not in spec and os.environ.get("AWS_ACCESS_KEY_ID"):
        return {**spec, "aws_credentials": {"type": "environment"}}
    return spec


def _endpoint(spec: dict) -> str:
    """Where the store's server is, for messages: a spec's ``endpoint``, or GCS's ``TENSORSTORE_GCS_HTTP_URL``."""
    endpoint = spec.get("endpoint") or (os.environ.get("TENSORSTORE_GCS_HTTP_URL") if spec["driver"] == "gcs" else None)
    return f" at {endpoint}" if endpoint else ""


def store_failed(error: BaseException) -> bool:
    """Whether a failed request is the store's fault (unreachable, credentials refused, bucket gone), not a record's."""
    text = str(error)
    return any(code in text for code in _STORE_FAULTS) or "NoSuchBucket" in text


def describe_store_error(url: str, error: BaseException, *, store_timeout: float) -> str:
    """What went wrong with the store ``url`` and what to do about it.

    Args:
      url: the store, as named in stats (its endpoint included where one is set).
      error: what a tensorstore operation on it raised.
      store_timeout: the retries' bound, for the message.

    Returns:
      One sentence naming the store, the fault and the remedy.
    """
    text = _HTTP_DETAIL.sub("", str(error).splitlines()[0] if str(error) else type(error).__name__)
    if any(code in text for code in _REFUSED):
        return (
            f"object store {url} refused the credentials ({text}); give credentials that may write there, as tensorstore "
            "reads them (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, an aws_credentials spec, or Google application "
            "default credentials)"
        )
    if "NoSuchBucket" in text or "NOT_FOUND" in text:  # a write, or a store fault, finds NOT_FOUND only for a bucket
        return f"object store {url}: the bucket does not exist ({text}); create it, or fix the bucket's name"
    if store_failed(error):
        return (
            f"object store {url} is unreachable ({text}), after retrying for up to store_timeout={store_timeout:g}s; "
            "check the endpoint and the network, or raise store_timeout for a store that is slow to come back"
        )
    return f"I/O on object store {url} failed: {text}; check the store, then retry or give another path"


class _Outages:
    """What the requests to one store share: how often one found it unreachable, and the last such error.

    Once one has, a new request first asks the store once, without retries (``alive``), and fails at
    once while it still does not answer: a pipeline that goes on reading would otherwise wait
    ``store_timeout`` again for each request it starts.
    """

    def __init__(self, alive: Callable[[], None]):
        self._lock = threading.Lock()
        self._alive = alive
        self.count = 0
        self.error: BaseException | None = None

    def found(self, error: BaseException) -> None:
        with self._lock:
            self.count, self.error = self.count + 1, error

    def check(self) -> None:
        """Raises the last outage's error if the store was found unreachable and still does not answer."""
        error = self.error
        if error is None:
            return
        try:
            self._alive()
        except Exception as again:
            if store_failed(again):
                raise ValueError(str(error)) from None
            raise
        with self._lock:
            if self.error is error:
                self.error = None


class _Request:
    """A record's read or write that gives up as soon as another request to its store, started no later,
    has found the store unreachable: it would only go on retrying against the same server for up to
    ``store_timeout`` more, and an update waits for every request in flight before it fails."""

    def __init__(self, future: ts.Future, outages: _Outages):
        self._future, self._outages, self._seen = future, outages, outages.count

    def result(self) -> Any:
        while True:
            try:
                return self._future.result(timeout=OUTAGE_POLL)
            except TimeoutError:
                if self._outages.count != self._seen:
                    self._future.cancel()
                    raise ValueError(str(self._outages.error)) from None
            except Exception as error:
                if store_failed(error):
                    self._outages.found(error)
                raise


class _StoreArray:
    """A record's array on a store, whose transfers are :class:`_Request`s."""

    def __init__(self, array: ts.TensorStore, outages: _Outages):
        self._array, self._outages = array, outages

    @property
    def shape(self) -> tuple[int, ...]:
        return self._array.shape

    def read(self) -> _Request:
        self._outages.check()
        return _Request(self._array.read(), self._outages)

    def write(self, record: np.ndarray) -> _Request:
        self._outages.check()
        return _Request(self._array.write(record), self._outages)


class KvStoreBackend:
    """A :class:`~jax_mlp._src.storage.backend.Backend` under a tensorstore kvstore spec.

    A kvstore has no lock that the operating system lets go of when its holder dies, so it is not
    held (one writer per run is the user's to keep), and no free-space figure, so it is not checked
    for room. Opening writes and deletes a probe key, so a missing bucket, refused credentials or an
    unreachable server fail here, naming the store.

    Args:
      spec: the kvstore spec (``driver``, ``path`` and the driver's options).
      process_index: this process's index.
      store_timeout: seconds of retries before a failing request fails.

    Raises:
      PathError: the spec cannot be opened, or the store cannot be written.
    """

    def __init__(self, spec: dict, process_index: int, store_timeout: float):
        self._base = with_credentials(dict(spec))
        prefix = self._base.get("path", "")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        self._prefix = f"{prefix}proc{process_index:04d}/"
        self.root = kvstore_url(spec)
        self.directory = f"{self.root}proc{process_index:04d}/"
        self._where = _endpoint(self._base)
        self._store_timeout = store_timeout
        self._context = store_context(retries_within(store_timeout))
        try:
            self._kvstore = ts.KvStore.open({**self._base, "path": self._prefix}, context=self._context).result()
            once = store_context(ONE_RETRY)
            quick = ts.KvStore.open({**self._base, "path": self._prefix}, context=once).result()
        except Exception as error:
            raise PathError(f"path {self.root} cannot be opened as a tensorstore kvstore: {error}") from error
        self._outages = _Outages(lambda: quick.read(RUN_FILE).result())
        try:
            self._kvstore.write(".write_probe", b"0").result()
            self._kvstore.delete_range(ts.KvStore.KeyRange(".write_probe", ".write_probe\0")).result()
        except Exception as error:
            raise PathError(f"writing {self.directory}: {self.describe(error)}") from error

    def describe(self, error: BaseException) -> str:
        return describe_store_error(f"{self.root}{self._where}", error, store_timeout=self._store_timeout)

    def path_failed(self, error: BaseException) -> bool:
        return store_failed(error)

    def open_record(self, name: str, nbytes: int | None, *, create: bool) -> RecordArray:
        spec = zarr3_spec({**self._base, "path": f"{self._prefix}{name}/"}, nbytes)
        return _StoreArray(open_zarr3(spec, self._context, create=create), self._outages)

    def has_record(self, name: str) -> bool:
        return True  # asking costs a request too: a missing record fails its read, which counts as absent

    def delete_record(self, name: str) -> None:
        self._kvstore.delete_range(ts.KvStore.KeyRange(f"{name}/", f"{name}0")).result()

    def vanished(self) -> bool:
        return False  # a kvstore has no directory to vanish; a failed read is a missing record

    def read_run_file(self) -> bytes | None:
        try:
            value = self._kvstore.read(RUN_FILE).result()
        except Exception as error:
            raise PathError(f"reading {self.directory}{RUN_FILE}: {self.describe(error)}") from error
        return value.value if value.state == "value" else None

    def write_run_file(self, content: bytes) -> None:
        self._kvstore.write(RUN_FILE, content).result()  # one object: a reader sees the old or the new one

    def room(self) -> None:
        return None  # object stores report no free space

    def hold(self) -> None:
        pass  # object stores have no lock that the OS releases when its holder dies

    def release(self) -> None:
        pass  # nothing is held

    def remove(self) -> None:
        self._kvstore.delete_range(ts.KvStore.KeyRange()).result()
