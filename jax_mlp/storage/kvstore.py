"""The kvstore backend: a path given as a tensorstore kvstore spec (object storage, memory, ...).

Records live under ``<spec path>proc{process_index}/``, and the run file is a key there. tensorstore
moves the bytes. A spec is opened in one tensorstore context, so a ``memory`` store lives as long as
its backend.
"""

from __future__ import annotations

import tensorstore as ts

from jax_mlp.errors import PathError
from jax_mlp.storage.backend import RUN_FILE, RecordArray, describe_os_error, open_zarr3, zarr3_spec


class KvStoreBackend:
    """A :class:`~jax_mlp.storage.backend.Backend` under a tensorstore kvstore spec.

    A kvstore has no lock that the operating system lets go of when its holder dies, so it is not
    held, and no free-space figure, so it is not checked for room.

    Args:
      spec: the kvstore spec (``driver``, ``path`` and the driver's options).
      process_index: this process's index.

    Raises:
      PathError: the spec cannot be opened, or the store cannot be written.
    """

    def __init__(self, spec: dict, process_index: int = 0):
        self._base = dict(spec)
        prefix = self._base.get("path", "")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        self._prefix = f"{prefix}proc{process_index:04d}/"
        self.root = f"{self._base['driver']}://{prefix}"
        self.directory = f"{self._base['driver']}://{self._prefix}"
        self._context = ts.Context({"file_io_sync": False})
        try:
            self._kvstore = ts.KvStore.open({**self._base, "path": self._prefix}, context=self._context).result()
        except Exception as error:
            raise PathError(f"path {self.root} cannot be opened as a tensorstore kvstore: {error}") from error
        try:
            self._kvstore.write(".write_probe", b"0").result()
            self._kvstore.delete_range(ts.KvStore.KeyRange(".write_probe", ".write_probe\0")).result()
        except Exception as error:
            raise PathError(f"writing {self.directory}: {describe_os_error(self.root, error)}") from error

    def open_record(self, name: str, nbytes: int | None, *, create: bool) -> RecordArray:
        spec = zarr3_spec({**self._base, "path": f"{self._prefix}{name}/"}, nbytes)
        return open_zarr3(spec, self._context, create=create)

    def has_record(self, name: str) -> bool:
        return True  # asking costs a request too: a missing record fails its read, which counts as absent

    def delete_record(self, name: str) -> None:
        self._kvstore.delete_range(ts.KvStore.KeyRange(f"{name}/", f"{name}0")).result()

    def vanished(self) -> bool:
        return False  # a kvstore has no directory to vanish; a failed read is a missing record

    def read_run_file(self) -> bytes | None:
        value = self._kvstore.read(RUN_FILE).result()
        return value.value if value.state == "value" else None

    def write_run_file(self, content: bytes) -> None:
        self._kvstore.write(RUN_FILE, content).result()

    def room(self) -> None:
        return None  # object stores report no free space

    def hold(self) -> None:
        pass  # object stores have no lock that the OS releases when its holder dies

    def release(self) -> None:
        pass  # nothing is held

    def remove(self) -> None:
        self._kvstore.delete_range(ts.KvStore.KeyRange()).result()
