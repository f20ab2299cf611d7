"""What the examples share: the offload's command-line options, and state paths in a temporary directory.

The examples import it from their own directory, so run them as ``python examples/NAME.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
from collections.abc import Iterator

import optax

import jax_mlp


def add_offload_arguments(parser: argparse.ArgumentParser, *, steps: int, host_cache: str, subgroup_size: str) -> None:
    """Adds ``--steps``, ``--paths``, ``--host-cache`` and ``--subgroup-size`` with these defaults."""
    parser.add_argument("--steps", type=int, default=steps, help="training steps")
    parser.add_argument(
        "--paths",
        nargs="+",
        default=None,
        help="directories for the offloaded optimizer state, e.g. one on NVMe and one on a parallel file system "
        "(new or empty). Default: sub-directories of a temporary directory, removed at the end",
    )
    parser.add_argument("--host-cache", default=host_cache, help="host RAM that may hold state records between updates")
    parser.add_argument("--subgroup-size", default=subgroup_size, help="bytes of optimizer state streamed at a time")


def add_state_codec_argument(parser: argparse.ArgumentParser) -> None:
    """Adds ``--state-codec {none,bf16,int8}``: how the optimizer state is kept between steps."""
    parser.add_argument(
        "--state-codec",
        choices=("none", *jax_mlp.quantized.CODECS),
        default="none",
        help="keep the optimizer's moments in bf16 or blockwise int8 (jax_mlp.quantized_state): 2x or 4x fewer "
        "bytes offloaded; none keeps them exact",
    )


def with_state_codec(inner: optax.GradientTransformation, codec: str) -> optax.GradientTransformation:
    """``inner`` itself for ``"none"``, else ``jax_mlp.quantized_state(inner, codec)``."""
    return inner if codec == "none" else jax_mlp.quantized_state(inner, codec)


@contextlib.contextmanager
def state_paths(paths: list[str] | None, *, count: int, prefix: str) -> Iterator[tuple[list[str], bool]]:
    """The given paths, or ``count`` directories in a new temporary directory that is removed at the end.

    Yields:
      The paths, and whether they are temporary (then close the offload with ``delete=True``).
    """
    if paths:
        yield paths, False
        return
    temp_dir = tempfile.mkdtemp(prefix=prefix)
    try:
        yield [f"{temp_dir}/path{i}" for i in range(count)], True
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
