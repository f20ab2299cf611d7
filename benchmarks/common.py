"""What the benchmarks share: a ``--smoke`` run for tests, showing a result and keeping it, and the ``jax-mlp`` command.

The benchmarks import it from their own directory, so run them as ``python benchmarks/NAME.py``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

RECORD_HEADER = 64
"""Bytes of a record before its payload (docs/concepts.md): a cache holds whole records, and a step moves them."""


def parse_with_smoke(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, smoke: dict[str, Any]
) -> argparse.Namespace:
    """Parses ``argv`` with a ``--smoke`` flag added to ``parser``: with it, the ``smoke`` values replace the options.

    Tests run a benchmark end to end with ``--smoke`` in a few seconds.
    """
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds (for tests)")
    args = parser.parse_args(argv)
    if args.smoke:
        for name, value in smoke.items():
            setattr(args, name, value)
    return args


def print_and_save(result: dict[str, Any], out: pathlib.Path | None) -> None:
    """Prints ``result`` as indented JSON, and writes the same text to ``out`` (its folder made) when given."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def jax_mlp_json(*args: str) -> Any:
    """What ``jax-mlp ARGS --json`` prints (``python -m jax_mlp`` in this interpreter): the model and the probe
    as the public face has them. A failure raises with the command's message."""
    done = subprocess.run([sys.executable, "-m", "jax_mlp", *args, "--json"], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"jax-mlp {' '.join(args)} failed: {done.stderr.strip()}")
    return json.loads(done.stdout)


def probe(location: str, state_bytes: int) -> dict:
    """What ``jax-mlp probe`` measures of a directory: its read and write bandwidth and ``serial``, with up to
    64 MiB in records of 4 MiB."""
    (measured,) = jax_mlp_json("probe", location, "--size", str(min(64 * 2**20, state_bytes)), "--record", "4MiB")
    return measured
