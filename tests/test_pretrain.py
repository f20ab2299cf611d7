"""``examples/pretrain.py`` on 8 fake devices: killed with -9 mid-run, ``--resume`` ends where an uninterrupted run does.

Each run is a child process with its own 8 fake CPU devices (FSDP over all of them). The batches depend
only on the step, so a resumed run must reach the uninterrupted run's params: from the tiers after the
kill (the params come back from the fp32 masters), and from the latest checkpoint once the paths are
gone. The step-8 checkpoints are compared bit for bit, within the core bf16 bound.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from helpers import assert_bf16_within_ulp

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "pretrain.py"
STEPS = 8
SIZES = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "8"]
TIERS = ["--accumulate", "2", "--save-every", "4", "--subgroup-size", "8KiB", "--host-cache", "16KiB"]
TIMEOUT = 300


def _command(workdir: Path, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--workdir", str(workdir), "--steps", str(STEPS), *SIZES, *TIERS, *extra]


def _environment() -> dict[str, str]:
    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=9", "")
    # As nox -s pretrain: more XLA CPU threads than devices, or the FSDP all-reduce hangs on 2 cores.
    devices = f"{flags} --xla_force_host_platform_device_count=8"
    return {**os.environ, "XLA_FLAGS": devices, "JAX_PLATFORMS": "cpu", "NPROC": "24"}


def _run(workdir: Path, *extra: str) -> dict:
    done = subprocess.run(
        _command(workdir, *extra), capture_output=True, text=True, timeout=TIMEOUT, env=_environment()
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run_until_killed(workdir: Path, after_step: int) -> None:
    """Starts a run and SIGKILLs it once its telemetry log shows update ``after_step`` done."""
    log = workdir / "log.jsonl"
    child = subprocess.Popen(
        _command(workdir), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_environment()
    )
    deadline = time.monotonic() + TIMEOUT
    try:
        while time.monotonic() < deadline and child.poll() is None:
            complete_lines = log.read_text().split("\n")[:-1] if log.exists() else []
            if any(json.loads(line)["step"] >= after_step for line in complete_lines):
                child.send_signal(signal.SIGKILL)
                break
            time.sleep(0.05)
        assert child.wait(timeout=60) == -signal.SIGKILL, f"the run was not killed mid-run: {child.stderr.read()}"
    finally:
        child.kill()


def _params_at(workdir: Path, step: int) -> list[np.ndarray]:
    with ocp.CheckpointManager(workdir / "checkpoints") as manager:
        restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore()))
    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(restored["params"])]


def test_pretrain_killed_mid_run_resumes_from_the_tiers_and_from_a_checkpoint(tmp_path):
    straight = _run(tmp_path / "straight")
    assert straight["start"] == "fresh" and straight["step"] == STEPS
    assert straight["checkpoints"] == [4, 8]
    expected = _params_at(tmp_path / "straight", STEPS)
    assert all(leaf.dtype.name == "bfloat16" for leaf in expected)

    crashed = tmp_path / "crashed"
    _run_until_killed(crashed, after_step=5)
    resumed = _run(crashed, "--resume")
    # Step 5's cached records reach the paths in the idle time after its update: a kill before they
    # land resumes at step 4 (docs/checkpoints.md, "Crash consistency"), one after at step 5.
    assert resumed["start"] == "tiers" and 4 <= resumed["start_step"] < STEPS, resumed
    assert resumed["step"] == STEPS
    assert_bf16_within_ulp(_params_at(crashed, STEPS), expected, "resumed from the tiers")

    # The paths are lost (a new node): --resume falls back to the latest checkpoint left, step 4.
    for name in ("nvme", "pfs", "checkpoints/8"):
        shutil.rmtree(tmp_path / "straight" / name)
    restored = _run(tmp_path / "straight", "--resume")
    assert restored["start"] == "checkpoint step 4" and restored["step"] == STEPS, restored
    assert_bf16_within_ulp(_params_at(tmp_path / "straight", STEPS), expected, "resumed from the step-4 checkpoint")
