"""The benchmarks run end to end on tiny sizes and write what they promise (no timing asserted)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from helpers import load_module

from jax_mlp._src import state_codecs
from jax_mlp._src.cli.ablation import ABLATION
from jax_mlp._src.storage.chunk_files import CHUNK_REQUESTS
from jax_mlp._src.storage.record import HEADER_SIZE, chunk_bytes

ROOT = pathlib.Path(__file__).parents[1]


def test_ablation_benchmark_writes_json_and_png(tmp_path):
    ablation = load_module(ROOT / "benchmarks" / "ablation.py")
    result = ablation.main(
        [
            "--state",
            "2MiB",
            "--subgroup-size",
            "128KiB",
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
    rows = written["ablation"]["rows"]
    assert [row["variant"] for row in rows] == [v.name for v in ABLATION] + [
        "+bf16 state",
        "+int8 state",
    ]
    assert all(row["predicted_s"] > 0 and len(row["update_s"]) == 2 for row in rows)
    assert all(row["speedup_vs_baseline"] > 0 for row in rows)
    # int8 state is small enough here for the cache and the records whose writes run on past the update to hold it
    assert all((row["in_update_io_bound_s"] > 0) == (row["codec"] != "int8") for row in rows)
    assert all(("ideal_speedup" in row) == (row["codec"] == "none") for row in rows)
    stored = {row["codec"]: row["stored_bytes"] for row in rows}
    assert stored["int8"] < stored["bf16"] < stored["none"]
    assert written["ablation"]["full_vs_baseline_of_ideal"] > 0
    assert len(result["rebalance"]["update_s"]) == 10
    assert (tmp_path / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bytes_per_param_benchmark_measures_every_storage_from_the_stats(tmp_path):
    bench = load_module(ROOT / "benchmarks" / "bytes_per_param.py")
    bench.main(["--rows", "64", "--out", str(tmp_path / "bytes.json")])
    rows = json.loads((tmp_path / "bytes.json").read_text())["bytes_per_param"]
    read = {(row["params"], row["codec"]): row["read_per_param"] for row in rows}
    assert len(read) == len(bench.PARAMS) * len(bench.CODECS)
    for codec in bench.CODECS:  # a remainder is the master's low 2 bytes of 4; headers add a little
        full, remainder = read["bf16 + fp32 master, full", codec], read["bf16 + fp32 master, remainder", codec]
        assert 1.99 <= full - remainder <= 2.01, (codec, full, remainder)
    assert 10 <= read["bf16 + fp32 master, remainder", "none"] <= 10.1
    assert all(row["written_per_param"] == row["read_per_param"] for row in rows)


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
    by_transfer = result["update"]["by_transfer"]  # each transfer path ran, and its stats say which
    assert {name: row["ran"] for name, row in by_transfer.items()} == {
        "auto": "plain",
        "pinned": "pinned",
        "plain": "plain",
    }
    assert result["transfer_paths"]["pinned_s"] > 0 and result["transfer"]["pinned_d2h_view"] > 0
    layers = json.loads((tmp_path / "layers_step.json").read_text())  # the layer-streamed step, exact
    assert layers["dry_run"] and layers["step"]["streamed_s"] > 0 and layers["exact"]["streamed_vs_cached_bitwise"]
    assert layers["exact"]["vs_in_memory_over_max_p"] <= 1e-2, layers["exact"]  # one bf16 ulp of the largest param


def test_efficiency_benchmark_writes_json_and_png(tmp_path):
    efficiency = load_module(ROOT / "benchmarks" / "efficiency.py")
    result = efficiency.main(["--smoke", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "efficiency.json").read_text())
    assert written == json.loads(json.dumps(result))
    raw, update, bound, cached = written["raw"], written["update"], written["bound"], written["cached_vs_optax"]
    assert raw["mode"] in ("O_DIRECT", efficiency.BUFFERED)
    assert all(raw[f"{kind}_bytes_per_s"] > 0 for kind in ("read", "write", "both"))
    assert set(raw["shapes"]) == {"records", "chunks"}
    # What the benchmark reads off the public face is what the library does: record and chunk sizes, chunks in flight
    plan_bytes = update["state_bytes"] + HEADER_SIZE * update["records"]
    assert update["record_bytes"] * update["records"] == plan_bytes
    assert raw["shapes"]["chunks"]["request_bytes"] == chunk_bytes(update["record_bytes"])
    assert raw["shapes"]["chunks"]["threads"] == efficiency.CHUNKS_IN_FLIGHT == CHUNK_REQUESTS
    assert len(update["updates"]) == 2 and update["median"]["seconds"] > 0
    assert update["median"]["bytes_read"] > 0 and update["median"]["bytes_written"] > 0
    parts = ("read_wait_s", "compute_s", "write_wait_s", "python_overhead_s")
    assert all(sum(split[part] for part in parts) == pytest.approx(split["seconds"]) for split in update["updates"])
    assert bound["bound_s"] > 0 and bound["ratio"] > 0 and bound["ratio_to_concurrent_bound"] > 0
    assert cached["optax_median_s"] > 0 and cached["ratio"] > 0 and cached["cpu_ratio"] > 0
    assert cached["fused_median_s"] > 0 and cached["fused_ratio"] > 0 and cached["fused_cpu_ratio"] > 0
    assert all(split["bytes_read"] == 0 for split in cached["offload_splits"])  # the cache serves every read
    assert written["checksum"]["used_bytes_per_s"] > 0 and not written["larger_than_ram"]["run"]
    assert (tmp_path / "efficiency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_check_cost_benchmark_writes_json(tmp_path):
    check_cost = load_module(ROOT / "benchmarks" / "check_cost.py")
    result = check_cost.main(
        [
            "--layers",
            "2",
            "--width",
            "8",
            "--vocab",
            "16",
            "--repeats",
            "1",
            "--subgroup-size",
            "32",
            "--out",
            str(tmp_path),
        ]
    )  # 32-byte subgroups: every leaf's state is above them, so a leaf kept whole is one the check keeps whole
    written = json.loads((tmp_path / "check_cost.json").read_text())
    assert written == json.loads(json.dumps(result)) and written["leaves"] == 2 * 11 + 3
    rows = {row["optimizer"]: row for row in written["rows"]}
    assert set(rows) == set(check_cost.OPTIMIZERS) and all(row["check_s"] > 0 for row in rows.values())
    assert rows["adamw"]["whole_leaves"] == 0 and rows["lamb"]["whole_leaves"] == written["leaves"]
    assert rows["chain(clip_by_global_norm, adam)"]["refused"] == "CoupledOptimizerError"


def test_state_codecs_benchmark_measures_every_map_and_codec(tmp_path):
    bench = load_module(ROOT / "benchmarks" / "state_codecs.py")
    result = bench.main(["--steps", "30", "--out", str(tmp_path / "codecs.json")])
    assert json.loads((tmp_path / "codecs.json").read_text()) == result
    assert set(result["nu_maps"]) == set(bench.NU_MAPS)
    assert set(result["final_loss"]) == {"fp32", "bf16", "int8", "bf16 stochastic"}
    assert bench.BLOCK == state_codecs.BLOCK_SIZE  # the maps compared are blocked as the int8 codec is
    ours = result["nu_maps"]["block float of sqrt, 4 fraction bits (quantized_state)"]
    assert ours["nu_zeroed_share"] == 0 and ours["update_rel_l2_err"] < 0.05
    assert ours["nu_rel_err_p99"] < result["nu_maps"]["block float of sqrt, 3 fraction bits"]["nu_rel_err_p99"]


def test_checksum_benchmark_measures_the_crcs_and_the_uncached_update(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the update's path is a temporary directory here
    checksum = load_module(ROOT / "benchmarks" / "checksum.py")
    result = checksum.main(["--buffer", "1MiB", "--state", "2MiB", "--updates", "1", "--rounds", "1"])
    assert {"zlib.crc32", "isal.isal_zlib.crc32"} <= set(result["gb_per_s"])
    assert result["update_cpu_s"]["median"] > 0 and len(result["update_cpu_s"]["all"]) == 1
    assert result["checksummed_bytes"] > 2 * 2 * 1024**2  # the whole state read and written, headers besides
    cost = result["checksum_cpu_s"]
    assert set(cost) == set(result["gb_per_s"]) and cost["zlib.crc32"] > 0 and cost["isal.isal_zlib.crc32"] > 0


def test_accumulation_benchmark_writes_json(tmp_path):
    accumulation = load_module(ROOT / "benchmarks" / "accumulation.py")
    options = ["--state", "2MiB", "--subgroup-size", "256KiB", "--cap", "400MB/s", "--updates", "2", "--idle", "0"]
    result = accumulation.main([*options, "--out", str(tmp_path), "--dir", str(tmp_path / "tiers")])
    written = json.loads((tmp_path / "accumulation.json").read_text())
    assert written == json.loads(json.dumps(result))
    assert written["same_bytes_per_update"] and written["update_time_ratio"] > 0
    assert [len(written[run]["updates"]) for run in ("single", "accumulated")] == [2, 2]
    assert written["accumulated"]["accumulate_steps"] == 4


def test_routes_benchmark_times_the_split_step_the_in_jit_route_and_plain_optax(tmp_path):
    routes = load_module(ROOT / "benchmarks" / "routes.py")
    result = routes.main(["--width", "32", "--layers", "2", "--steps", "3", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "routes.json").read_text()) == result
    assert set(result["routes"]) == {"split", "in_jit", "plain"} and result["params"] == 2 * (32 * 32 + 32)
    assert all(r["first_step_s"] > 0 and r["median_step_s"] > 0 for r in result["routes"].values())


def test_update_path_lists_the_modules_one_update_enters_and_nothing_outside_its_layers(tmp_path):
    update_path = load_module(ROOT / "benchmarks" / "update_path.py")
    result = update_path.main(["--out", str(tmp_path)])
    assert json.loads((tmp_path / "update_path.json").read_text()) == result
    modules = result["modules"]
    assert result["count"] == len(modules) == len(set(modules))
    for hop in (
        "offload/route.py",
        "offload/split.py",
        "stream/state_stream.py",
        "stream/engine.py",
        "schedule/scheduler.py",
    ):
        assert os.path.join("_src", hop) in modules, (hop, modules)
    assert not [m for m in modules if m.startswith((os.path.join("_src", "cli"), os.path.join("_src", "checkpoint")))]


def test_two_paths_benchmark_runs_every_route_against_the_write_bound(tmp_path):
    result = load_module(ROOT / "benchmarks" / "two_paths.py").main(["--smoke", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "two_paths_emulated.json").read_text()) == json.loads(json.dumps(result))
    (run,) = result["pairs"]["100MB/s"]
    routes = run["routes"]
    assert [len(routes[name]["step_s"]) for name in ("fast_alone", "two_paths", "overlapped", "timed")] == [3, 3, 3, 12]
    assert all(route["rolled_back"] == 0 for route in routes.values())
    # (with a batch of 8 the backward may hand everything over before update is called: no count of early work)
    assert sum(routes["two_paths"]["overlapped"]) == sum(routes["fast_alone"]["overlapped"]) == 0
    assert not any(routes["overlapped"]["overlap_fallback"])  # "always": never timed, never fallen back
    assert sum(routes["timed"]["overlapped"][5:9]) == 0  # the trial's split steps
    assert len(routes["fast_alone"]["placement"][-1]) == 1 and len(routes["two_paths"]["placement"][-1]) == 2
    state = routes["two_paths"]["state_bytes"]
    assert run["write_bound_s"] == state / sum(run["write_rates"].values()) > 0
    assert run["two_paths_over_fast_alone"] > 0 and result["worst_timed_over_split_step"] > 0
