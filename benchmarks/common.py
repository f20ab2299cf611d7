"""What the benchmarks share: showing a result and keeping it.

The benchmarks import it from their own directory, so run them as ``python benchmarks/NAME.py``.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any


def print_and_save(result: dict[str, Any], out: pathlib.Path | None) -> None:
    """Prints ``result`` as indented JSON, and writes the same text to ``out`` when given."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        out.write_text(text + "\n")
