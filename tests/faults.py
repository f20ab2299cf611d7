"""Write faults injected through the storage backend seam, for the tests of what a failed write leaves behind.

Every path an offloader opens comes from :func:`jax_mlp._src.storage.paths.open_path`. :func:`inject_write_faults`
wraps the backend of each path opened from then on, so that while a fault is on, its record writes raise
the given error, as the operating system would raise it. Reads, the run file and the lock pass through.
"""

from __future__ import annotations

from jax_mlp._src.storage import paths
from jax_mlp._src.storage.backend import Backend, RecordArray
from jax_mlp._src.storage.paths import PathStore


class WriteFault:
    """The switch: which paths' record writes fail, and with what error; off until :meth:`fail`."""

    def __init__(self):
        self.error: BaseException | None = None
        self.root: str | None = None

    def fail(self, error: BaseException, root: str | None = None) -> None:
        """Fails every record write to the path ``root`` (to every path, if None) with ``error``."""
        self.error, self.root = error, root

    def clear(self) -> None:
        """Lets writes through again: space freed, permissions fixed."""
        self.error = None

    def check(self, root: str) -> None:
        if self.error is not None and self.root in (None, root):
            raise self.error


class _FailingArray:
    """A record's array whose writes fail while its path's fault is on."""

    def __init__(self, array: RecordArray, fault: WriteFault, root: str):
        self._array, self._fault, self._root = array, fault, root

    def __getattr__(self, name):
        return getattr(self._array, name)

    def write(self, record):
        self._fault.check(self._root)
        return self._array.write(record)


class FailingBackend:
    """``backend``, except that the records it opens fail their writes while ``fault`` is on."""

    def __init__(self, backend: Backend, fault: WriteFault):
        self._backend, self._fault = backend, fault

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def open_record(self, name: str, nbytes: int | None, *, create: bool) -> RecordArray:
        return _FailingArray(self._backend.open_record(name, nbytes, create=create), self._fault, self._backend.root)


def inject_write_faults(monkeypatch) -> WriteFault:
    """Opens every path from now on (until ``monkeypatch.undo()``) on a :class:`FailingBackend`; returns its switch."""
    fault = WriteFault()
    open_path = paths.open_path

    def open_failing_path(path, *args, **kwargs):
        store = open_path(path, *args, **kwargs)
        return PathStore(FailingBackend(store.backend, fault), store.traffic)

    monkeypatch.setattr(paths, "open_path", open_failing_path)
    return fault
