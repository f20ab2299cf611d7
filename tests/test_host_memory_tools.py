"""Params in host memory beyond the library: the example's checks, ``jax-mlp plan --params-in host``, the GPU benchmark."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from helpers import load_module

from jax_mlp._src.cli import main as cli
from jax_mlp._src.cli import sizing
from jax_mlp._src.parsing import format_bytes
from jax_mlp._src.storage.buffers import POOL_BYTES

ROOT = pathlib.Path(__file__).parents[1]
TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "8", "--steps", "4"]
MiB = 1024**2


@pytest.mark.parametrize(
    "variant",
    [
        ["--subgroup-size", "16KiB"],
        ["--subgroup-size", "16KiB", "--devices", "8", "--param-dtype", "bf16", "--apply", "--checkpoint-at", "2"],
    ],
    ids=["fp32_update", "bf16_master_apply_fsdp8_checkpoint"],
)
def test_host_params_example_trains_bitwise_as_device_params_and_within_the_contract(variant, tmp_path):
    example = load_module(ROOT / "examples" / "host_params.py")
    result = example.main([*TINY, *variant, "--compare", "--paths", str(tmp_path)])
    assert result["kinds"] == ["pinned_host"]
    assert result["bitwise_equal_to_device_params"] and result["within_contract"], result
    assert len(result["losses"]) == 4 and result["stats"]["step"] == 4
    assert sum(v for k, v in result["stats"].items() if k.startswith("bytes_read[")) > 0  # the state came from disk


def tables(capsys, *args: str) -> dict[str, dict[str, tuple[str, str]]]:
    """``jax-mlp plan ARGS``'s rows by table ("per device", "per node", "per update", "per step") and label.

    Each row is its figure (the 10 columns after its 30-wide label) and its note.
    """
    assert cli.main(["plan", *args]) == 0
    found: dict[str, dict[str, tuple[str, str]]] = {}
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("per "):
            table = found.setdefault(" ".join(line.split()[:2]).rstrip(":,"), {})
        elif line.startswith("  ") and found:
            table[line[2:32].rstrip()] = (line[33:43].strip(), line[45:])
    return found


def seconds(row: tuple[str, str]) -> float:
    return float(row[0].split()[0])


def test_plan_with_params_in_host_memory_streams_layers_and_adds_their_trips(capsys):
    # 1M bf16 params in 4 layers with a full fp32 master (12 B of state each), 2 processes of one node,
    # 1 MiB subgroups, a 1 GB/s link.
    args = ["--params", "1M", "--master", "--master-storage", "full", "--processes-per-node", "2", "--layers", "4"]
    args += ["--subgroup-size", "1MiB", "--paths", "nvme=1GB/s:500MB/s", "--host-cache", "4MiB", "--link", "1GB/s"]
    args += ["--prefetch-depth", "2", "--write-depth", "2", "--compute-s", "0.01", "--params-in", "host"]
    plan = tables(capsys, *args)
    device, node, update, step = (plan[f"per {name}"] for name in ("device", "node", "update", "step"))
    layer = 1e6 / 4 * 2
    assert device["params, streamed"][0] == device["grads, streamed"][0] == format_bytes(2 * layer)
    blocks = (2 + 2) * MiB / 12 * (2 + 2 + 4)  # 4 subgroups in flight: grads and params in (bf16), updates out (fp32)
    assert device["update adds, fused apply"][0] == format_bytes(3 * MiB + blocks)  # computing (in, out), one staging
    assert device["update adds, optax route"][0] == format_bytes(
        (2 + 2) * MiB + blocks
    )  # 2 read ahead, computing, staging
    assert node["params"][0] == node["grads"][0] == format_bytes(1e6 * 2)  # the node's share, in host RAM
    assert node["update adds, optax route"][0] == format_bytes(1e6 * (4 + 2))  # fp32 updates, new bf16 params
    cache, in_flight, staging = 2 * 2 * MiB, 2 * 5 * MiB, 2 * min(POOL_BYTES, 6e6)
    assert node["total"][0] == format_bytes(cache + in_flight + staging + 2 * sizing.PROCESS_BYTES + 4e6)
    state, params = 6e6, 5e5  # per process
    assert update["link floor"][0] == "0.008 s" == f"{(state + params * 4) / 1e9:.3g} s"  # 2 B grads + 2 B params in
    trips = 2 * 1e6 / 2 * 2 / 1e9  # each device's shard in twice
    assert step["params and grads over link"][0] == f"{trips:.3g} s"
    split = seconds(step["step, split"])
    assert abs(split - seconds(step["update"]) - (0.01 + trips)) <= 0.005 * split


def test_the_papers_70b_node_fits_with_params_in_host_memory_and_not_on_the_devices(capsys):
    node = ["--params", "70B", "--master", "--master-storage", "full", "--nodes", "1", "--processes-per-node", "4"]
    node += ["--paths", "nvme=6.5GB/s:3GB/s", "lustre=3GB/s:2GB/s", "--host-memory", "512GB", "--device-memory", "40GB"]
    on_device = tables(capsys, *node, "--host-cache", "440GiB")
    assert on_device["per device"]["peak, fused apply"][0] == "65.4 GiB"
    assert on_device["per device"]["peak, fused apply"][1].startswith("WARNING: over --device-memory")
    in_host = tables(capsys, *node, "--host-cache", "200GiB", "--params-in", "host", "--layers", "80")
    for route in ("optax route", "fused apply"):
        assert in_host["per device"][f"peak, {route}"][1].startswith("fits --device-memory")
    assert in_host["per node"]["total"][1].startswith("fits --host-memory")  # with the fused apply
    assert "WARNING: over --host-memory" in in_host["per node"]["update adds, optax route"][1]
    assert in_host["per node"]["params"][0] == in_host["per node"]["grads"][0] == format_bytes(70e9 * 2)
    assert seconds(in_host["per update"]["update"]) > seconds(on_device["per update"]["update"])  # a smaller cache


def test_params_in_host_without_layers_is_a_usage_error(capsys):
    assert cli.main(["plan", "--params", "7B", "--paths", "nvme=5GB/s", "--params-in", "host"]) == 2
    assert "--params-in host needs --layers" in capsys.readouterr().err


def test_gpu_host_params_benchmark_dry_run_on_cpu(tmp_path):
    script = ROOT / "benchmarks" / "gpu" / "host_params_step.py"
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, str(script), "--dry-run", "--out", str(tmp_path)], env=env, capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "host_params.json").read_text())
    assert result["dry_run"] and result["step"]["pinned_host"]["kinds"] == ["pinned_host"]
    assert result["step"]["device"]["kinds"] == ["device"]
    for kind in ("pinned_host", "device"):
        memory = result["device_memory"][kind]
        assert memory["at_twice"]["argument"] > memory["at_layers"]["argument"] > 0 and memory["layer_params"] > 0
    link = result["link"]
    assert link["pinned_copy"]["h2d"] > 0 and link["pinned_copy"]["d2h"] > 0
    assert link["bytes_per_step"] == 6 * link["pinned_copy"]["bytes"]
