"""What the benchmarks share: a ``--smoke`` run for tests, showing a result and keeping it.

The benchmarks import it from their own directory, so run them as ``python benchmarks/NAME.py``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections.abc import Sequence
from typing import Any


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
    """Prints ``result`` as indented JSON, and writes the same text to ``out`` when given."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        out.write_text(text + "\n")
