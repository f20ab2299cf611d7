"""Human values in and out: sizes ("256MiB"), rates ("400MB/s") and storage locations (directories, URLs).

Every option that takes a size, a rate or a path is parsed here, once, so the same spellings work
everywhere (``mlp_offload``, ``Path``, the ``jax-mlp`` command) and the errors read alike.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from jax_mlp._src.errors import OffloadError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "p": 1000**5,
    "pb": 1000**5,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, *, name: str = "size") -> int:
    """Parses a byte count: an int, or a string such as ``"256MiB"``, ``"1.5GB"`` or ``"0"``.

    Args:
      value: the size, as a number of bytes or a string with a unit (B, KB, MB, GB, TB, KiB, ...).
      name: the option's name, used in the error message.

    Returns:
      The size in bytes.

    Example:
      >>> import jax_mlp
      >>> jax_mlp.parse_size("256MiB"), jax_mlp.parse_size("1.5GB"), jax_mlp.parse_size(4096)
      (268435456, 1500000000, 4096)
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a size such as 268435456 or '256MiB', got {value!r}")
    if isinstance(value, (int, float, np.integer, np.floating)):
        number, unit = float(value), ""
    else:
        match = _SIZE_RE.match(str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise OffloadError(
                f"{name}={value!r} is not a size: write a number of bytes or a number with a unit "
                "such as '256MiB', '8GiB' or '500MB'"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    size = number * _UNITS[unit]
    if size < 0:
        raise OffloadError(f"{name}={value!r} must not be negative: give a size of 0 or more, such as '256MiB'")
    return int(size)


def parse_rate(value: int | float | str | None, *, name: str = "rate") -> float | None:
    """Parses a bandwidth: bytes per second, or a string such as ``"400MB/s"`` or ``"2GiB/s"``.

    Args:
      value: the rate, None for none.
      name: the option's name, used in the error message.

    Returns:
      Bytes per second (positive), or None.
    """
    if value is None:
        return None
    text = value.strip().removesuffix("/s") if isinstance(value, str) else value
    rate = float(parse_size(text, name=name))
    if rate <= 0:
        raise OffloadError(f"{name}={value!r} must be positive: give a rate such as '400MB/s', or None for none")
    return rate


def format_bytes(nbytes: float) -> str:
    """``nbytes`` with a binary unit, e.g. ``"1.5 MiB"``: the inverse of :func:`parse_size`, for messages.

    Args:
      nbytes: a number of bytes.

    Returns:
      The size, with one decimal above a KiB.

    Example:
      >>> import jax_mlp
      >>> jax_mlp.format_bytes(1536 * 1024), jax_mlp.format_bytes(512)
      ('1.5 MiB', '512 B')
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{int(nbytes)} B" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


_URL_SCHEMES = {"s3": "s3", "gcs": "gs"}
"""The URL scheme of each object-store driver, for names: ``s3://bucket/prefix/``, ``gs://bucket/prefix/``."""


def _parse_url(url: str) -> str | dict:
    """A kvstore URL (``s3://bucket/prefix``, ``gs://bucket/prefix``, ``memory://...``) as a spec; ``file://`` as a directory."""
    import tensorstore as ts  # the spec parser of the kvstores themselves

    try:
        spec = ts.KvStore.Spec(url).to_json()
    except ValueError as error:
        raise OffloadError(
            f"path {url!r} is not a tensorstore kvstore URL ({error}): give a directory, a URL such as "
            "'s3://bucket/prefix' or 'gs://bucket/prefix', or a kvstore spec dict"
        ) from None
    if spec["driver"] == "file":
        return spec["path"]
    return spec


def parse_location(location: str | os.PathLike | dict) -> str | dict:
    """An absolute directory, or a tensorstore kvstore spec (a dict with a ``driver``, or parsed from a URL)."""
    if isinstance(location, dict):
        if "driver" not in location:
            raise OffloadError(
                f"path {location!r} is a dict but not a tensorstore kvstore spec: it needs a 'driver', "
                "e.g. {'driver': 'file', 'path': '/nvme/run'}"
            )
        return dict(location)
    text = os.fspath(location)
    if isinstance(text, str) and "://" in text:
        parsed = _parse_url(text)
        if isinstance(parsed, dict):
            return parsed
        text = parsed
    return os.path.abspath(os.path.expanduser(text))


def kvstore_url(spec: Mapping[str, Any]) -> str:
    """How messages and stats name a kvstore spec: ``s3://bucket/prefix/``, ``gs://bucket/prefix/``, ``memory://prefix/``.

    Args:
      spec: a tensorstore kvstore spec.

    Returns:
      The URL of the spec's prefix, ending in ``/``; an ``endpoint`` is not part of it.
    """
    prefix = spec.get("path", "")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    driver = spec["driver"]
    if driver in _URL_SCHEMES:
        return f"{_URL_SCHEMES[driver]}://{spec.get('bucket', '')}/{prefix}"
    return f"{driver}://{prefix}"
