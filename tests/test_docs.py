"""The docs stay true: docs/api.md covers every public name and option, docs/architecture.md every module and import."""

from __future__ import annotations

import ast
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


ARCHITECTURE_MD = API_MD.parent / "architecture.md"
PACKAGE = Path(jax_mlp.__file__).resolve().parent


def _module_table() -> list[tuple[str, set[str]]]:
    """The rows of the modules table in docs/architecture.md: each module and the modules it says it imports."""
    rows = []
    for line in ARCHITECTURE_MD.read_text(encoding="utf-8").splitlines():
        match = re.match(r"\| `([\w/]+)\.py` \|.*\| (.*) \|$", line)
        if match:
            module = match.group(1).replace("/", ".")
            imports = set(re.findall(r"`([\w.]+)`", match.group(2)))
            rows.append((module, imports))
    return rows


def _imports_of(module: str) -> set[str]:
    """The jax_mlp modules ``module`` imports, anywhere in its source."""
    tree = ast.parse((PACKAGE / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jax_mlp"):
            if node.module == "jax_mlp":
                found.update(alias.name for alias in node.names)
            else:
                found.add(node.module.removeprefix("jax_mlp."))
    return found - {module}


def test_the_module_table_lists_every_module_and_its_imports() -> None:
    rows = _module_table()
    documented = [module for module, _ in rows]
    on_disk = sorted(
        str(path.relative_to(PACKAGE).with_suffix("")).replace("/", ".")
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py"
    )
    assert sorted(documented) == on_disk
    wrong = {
        module: (imports, _imports_of(module))
        for module, imports in rows
        if imports - {"nothing"} != _imports_of(module)
    }
    assert not wrong, f"docs/architecture.md's imports column differs from the code (said, actual): {wrong}"


def test_every_import_points_down_the_module_table() -> None:
    rows = _module_table()
    position = {module: index for index, (module, _) in enumerate(rows)}
    upward = [
        (module, imported)
        for module, _ in rows
        for imported in _imports_of(module)
        if imported in position and position[imported] <= position[module]
    ]
    assert not upward, f"imports that point up (or sideways) in docs/architecture.md's table: {upward}"


def test_help_explains_every_parameter_of_mlp_offload():
    """``help(jax_mlp.mlp_offload)`` documents each parameter of its signature, in order, and no other."""
    doc = inspect.getdoc(jax_mlp.mlp_offload)
    described = re.findall(r"^  (\w+):", doc[doc.index("Args:") : doc.index("Returns:")], re.MULTILINE)
    assert described == list(inspect.signature(jax_mlp.mlp_offload).parameters)
