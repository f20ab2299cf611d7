"""``jax_mlp/__init__.py`` and ``deprecated.py``: the public face (``jax_mlp``, ``jax_mlp.quantized``,
``jax_mlp.report``) and the flat layout's paths, deprecated.
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings

import pytest

import jax_mlp
from jax_mlp._src import deprecated


def test_every_public_name_is_named_by_its_public_path():
    """Tracebacks and reprs say ``jax_mlp.OffloadError``, not where it is implemented."""
    for name in jax_mlp.__all__:
        assert getattr(jax_mlp, name).__module__ == "jax_mlp", name
    assert repr(jax_mlp.PeerError) == "<class 'jax_mlp.PeerError'>"


def test_the_public_namespaces_import_on_first_use():
    assert "bf16" in jax_mlp.quantized.CODECS
    assert jax_mlp.report.load_log is jax_mlp.report.__dict__["load_log"]
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = jax_mlp.nothing


@pytest.mark.parametrize(
    ("old", "name", "public"),
    [
        ("jax_mlp.partition", "Plan", jax_mlp.Plan),
        ("jax_mlp.dependence", "check_optimizer", None),
        ("jax_mlp.stats", "format_bytes", jax_mlp.format_bytes),
        ("jax_mlp.stats", "IOEvent", jax_mlp.IOEvent),
        ("jax_mlp.config", "format_bytes", jax_mlp.format_bytes),
        ("jax_mlp.peers", "PeerError", jax_mlp.PeerError),
        ("jax_mlp.checkpoint", "restore_params", jax_mlp.restore_params),
        ("jax_mlp.checkpoint", "region_of", None),
        ("jax_mlp.scheduler", "Scheduler", None),
        ("jax_mlp.scheduler", "PathEstimate", None),
        ("jax_mlp.sharding", "LeafSharding", None),
        ("jax_mlp.model", "ABLATION", None),
        ("jax_mlp.model", "Workload", None),
        ("jax_mlp.offloader", "OffloadState", jax_mlp.OffloadState),
        ("jax_mlp.storage.tier_stack", "Pin", jax_mlp.Pin),
    ],
)
def test_an_old_import_path_still_works_and_warns(old, name, public):
    """The paths the docs showed before 0.2 keep working for one release, each with a DeprecationWarning."""
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = __import__(old, fromlist=[name])
    said = [str(w.message) for w in caught if w.category is DeprecationWarning]
    assert any(re.match(rf"{re.escape(old)} is deprecated .* jax_mlp\._src\.", text) for text in said), said
    value = getattr(module, name)
    if public is not None:
        assert value is public
    assert name in dir(module)


def test_every_old_module_maps_to_modules_that_exist():
    for old in deprecated.MOVED:
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning):
            module = __import__(old, fromlist=["__name__"])
        assert dir(module), old


def test_an_old_module_run_with_python_m_runs_its_new_one():
    run = subprocess.run(
        [sys.executable, "-W", "always::DeprecationWarning", "-m", "jax_mlp.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "usage: jax-mlp" in run.stdout
    assert "jax_mlp.cli is deprecated" in run.stderr
