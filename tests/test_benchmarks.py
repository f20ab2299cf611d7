"""The benchmarks run end to end on tiny sizes and write what they promise (no timing asserted)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1]


def load(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ablation_benchmark_writes_json_and_png(tmp_path):
    ablation = load(ROOT / "benchmarks" / "ablation.py")
    result = ablation.main(
        [
            "--state",
            "2MiB",
            "--subgroup-size",
            "256KiB",
            "--fast",
            "400MB/s",
            "--slow",
            "200MB/s",
            "--iterations",
            "2",
            "--idle",
            "0",
            "--out",
            str(tmp_path),
            "--dir",
            str(tmp_path / "tiers"),
        ]
    )
    written = json.loads((tmp_path / "ablation.json").read_text())
    assert [row["variant"] for row in written["ablation"]["rows"]] == [v.name for v in ablation.model.ABLATION]
    assert all(row["predicted_s"] > 0 and len(row["update_s"]) == 2 for row in written["ablation"]["rows"])
    assert len(result["rebalance"]["update_s"]) == 10
    assert (tmp_path / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpu_script_dry_run_on_cpu(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu" / "run.sh"), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["dry_run"] and result["transfer"]["pageable_h2d"] > 0
    assert result["update"]["offloaded_over_plain"] > 0 and result["streaming"]["bytes_per_s"] > 0
