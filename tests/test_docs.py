"""The docs stay true: docs/api.md covers every public name and option, docs/architecture.md every module and import."""

from __future__ import annotations

import ast
import doctest
import inspect
import re
import tempfile
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
SRC = PACKAGE / "_src"


def _module_table() -> list[tuple[str, set[str]]]:
    """The rows of the modules table in docs/architecture.md: each module under ``jax_mlp/_src`` and its imports."""
    rows = []
    for line in ARCHITECTURE_MD.read_text(encoding="utf-8").splitlines():
        match = re.match(r"\| `([\w/]+)\.py` \|.*\| (.*) \|$", line)
        if match:
            module = match.group(1).replace("/", ".")
            imports = set(re.findall(r"`([\w.]+)`", match.group(2)))
            rows.append((module, imports))
    return rows


def _imports_of(path: Path) -> set[str]:
    """The modules under ``jax_mlp/_src`` that the file at ``path`` imports, named relative to ``_src``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jax_mlp._src"):
            sub = node.module.removeprefix("jax_mlp._src").removeprefix(".")
            if not sub or (SRC / sub.replace(".", "/")).is_dir():  # a package: its names are modules
                found.update(f"{sub}.{alias.name}".lstrip(".") for alias in node.names)
            else:
                found.add(sub)
    return found


def _module_imports(module: str) -> set[str]:
    return _imports_of(SRC / (module.replace(".", "/") + ".py")) - {module}


def test_the_module_table_lists_every_module_and_its_imports() -> None:
    rows = _module_table()
    documented = [module for module, _ in rows]
    on_disk = sorted(
        str(path.relative_to(SRC).with_suffix("")).replace("/", ".")
        for path in SRC.rglob("*.py")
        if path.name != "__init__.py"
    )
    assert sorted(documented) == on_disk
    wrong = {
        module: (imports, _module_imports(module))
        for module, imports in rows
        if imports - {"nothing"} != _module_imports(module)
    }
    assert not wrong, f"docs/architecture.md's imports column differs from the code (said, actual): {wrong}"


def test_every_import_points_down_the_module_table() -> None:
    rows = _module_table()
    position = {module: index for index, (module, _) in enumerate(rows)}
    upward = [
        (module, imported)
        for module, _ in rows
        for imported in _module_imports(module)
        if imported in position and position[imported] <= position[module]
    ]
    assert not upward, f"imports that point up (or sideways) in docs/architecture.md's table: {upward}"


def test_each_folder_is_one_layer_of_the_table() -> None:
    """A folder's rows are contiguous, so the folders are the layers and a module only imports its own or lower ones."""
    folders = [module.rpartition(".")[0] for module, _ in _module_table()]
    runs = [folder for i, folder in enumerate(folders) if folder and (i == 0 or folders[i - 1] != folder)]
    assert len(runs) == len(set(runs)), f"a folder's modules are split in docs/architecture.md's table: {runs}"


def test_the_public_face_imports_only_the_private_modules_and_nothing_imports_the_face() -> None:
    face = [path for path in PACKAGE.glob("*.py")]
    assert {path.name for path in face} <= {"__init__.py", "__main__.py", "quantized.py", "report.py"}
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        face_imports = {
            name
            for name in imported
            if name == "jax_mlp" or (name.startswith("jax_mlp.") and not name.startswith("jax_mlp._src"))
        }
        assert not face_imports, (
            f"{path.relative_to(PACKAGE)} imports the public face {face_imports}: data flows one way"
        )


PUBLIC_MODULES = ("jax_mlp", "jax_mlp.quantized", "jax_mlp.report")
REPOSITORY = Path(__file__).resolve().parents[1]  # not PACKAGE.parent: CI installs jax_mlp into site-packages
SCRIPTS = sorted([*(REPOSITORY / "examples").glob("*.py"), *(REPOSITORY / "benchmarks").rglob("*.py")])


def _jax_mlp_names(node: ast.AST) -> set[str]:
    """The names under ``jax_mlp`` one AST node reaches: an import, a module path in a string, an attribute."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if isinstance(node, ast.ImportFrom) and node.module == "jax_mlp":  # from jax_mlp import _src
        return {f"jax_mlp.{alias.name}" for alias in node.names if alias.name not in jax_mlp.__all__}
    if isinstance(node, ast.ImportFrom) and node.module:
        return {node.module}
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"jax_mlp(\.\w+)+", node.value):
        return {node.value}  # importlib.import_module("jax_mlp._src...")
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "jax_mlp":
        return set() if node.attr in jax_mlp.__all__ or node.attr.startswith("__") else {f"jax_mlp.{node.attr}"}
    return set()


def _private_reaches(source: str) -> set[str]:
    """What ``source`` reaches of jax_mlp beyond its public face (``jax_mlp``'s ``__all__`` and its two namespaces)."""
    reached = set().union(*(_jax_mlp_names(node) for node in ast.walk(ast.parse(source))))
    return {name for name in reached if name.startswith("jax_mlp.") and name not in PUBLIC_MODULES}


@pytest.mark.parametrize(
    "source",
    [
        "from jax_mlp._src.storage import record",
        "import jax_mlp._src.stats as stats",
        "from jax_mlp import _src",
        "import importlib\nimportlib.import_module('jax_mlp._src.storage.record')",
        "import jax_mlp\njax_mlp._src.stats.UpdateStats",
        "import jax_mlp\nconfig = jax_mlp.config",
    ],
)
def test_reaching_past_the_public_face_is_found(source: str) -> None:
    assert _private_reaches(source)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda path: str(path.relative_to(REPOSITORY)))
def test_examples_and_benchmarks_import_only_the_public_face(path: Path) -> None:
    """Examples and benchmarks use what a user can: ``jax_mlp`` (its ``__all__``), its two namespaces, the command."""
    reached = _private_reaches(path.read_text(encoding="utf-8"))
    assert not reached, f"{path.relative_to(REPOSITORY)} reaches {reached}; use the names jax_mlp exports"


def test_the_public_face_passes_the_check() -> None:
    public = "import jax_mlp\nfrom jax_mlp import mlp_offload\nfrom jax_mlp.quantized import CODECS\n"
    assert not _private_reaches(public + "jax_mlp.report.load_log, jax_mlp.__file__, jax_mlp.OffloadError")
    assert len(SCRIPTS) > 20 and any(path.parent.name == "gpu" for path in SCRIPTS)


def test_help_explains_every_parameter_of_mlp_offload():
    """``help(jax_mlp.mlp_offload)`` documents each parameter of its signature, in order, and no other."""
    doc = inspect.getdoc(jax_mlp.mlp_offload)
    described = re.findall(r"^  (\w+):", doc[doc.index("Args:") : doc.index("Returns:")], re.MULTILINE)
    assert described == list(inspect.signature(jax_mlp.mlp_offload).parameters)


DOCTESTED = (
    "mlp_offload",
    "restore_params",
    "OffloadSave",
    "OffloadRestore",
    "OffloadConfig",
    "parse_size",
    "format_bytes",
    "stream_layers",
)


@pytest.mark.parametrize("name", DOCTESTED)
def test_the_docstring_example_runs(name: str, tmp_path, monkeypatch) -> None:
    """The examples in the public docstrings run as written and print what they say (doctest)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # their tempfile.mkdtemp() directories go with the test
    monkeypatch.setattr(tempfile, "tempdir", None)
    tests = doctest.DocTestFinder(recurse=False).find(getattr(jax_mlp, name), name=f"jax_mlp.{name}")
    examples = [test for test in tests if test.examples]
    assert examples, f"jax_mlp.{name}'s docstring has no example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in examples:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
