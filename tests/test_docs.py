"""The API reference in docs/api.md covers every public name and every option of mlp_offload."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import jax_mlp

API_MD = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def _headings() -> list[str]:
    return [line for line in API_MD.read_text(encoding="utf-8").splitlines() if line.startswith("#")]


@pytest.mark.parametrize("name", jax_mlp.__all__)
def test_public_name_has_a_heading(name: str) -> None:
    # The name as a whole token, in backticks or plain; "Offloader.init" does not count for "Offloader".
    pattern = re.compile(rf"(?<![\w.]){re.escape(name)}(?![\w.])")
    assert any(pattern.search(line) for line in _headings()), f"docs/api.md has no heading for {name}"


def test_every_mlp_offload_option_is_documented() -> None:
    text = API_MD.read_text(encoding="utf-8")
    keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = [p.name for p in inspect.signature(jax_mlp.mlp_offload).parameters.values() if p.kind in keyword_kinds]
    assert names
    missing = [name for name in names if f"`{name}`" not in text]
    assert not missing, f"docs/api.md does not mention mlp_offload options {missing}"
