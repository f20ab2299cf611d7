"""``cli/plan_command.py`` with ``cli/sizing.py``, ``cli/plan_tables.py`` and ``cli/speeds.py``: ``jax-mlp plan``
sizes a whole run, never crashes, and starts from the library's own defaults.
"""

from __future__ import annotations

import json
import math
import os
import re

import pytest

from jax_mlp._src.cli import command, plan_tables, sizing, speeds
from jax_mlp._src.cli import main as cli
from jax_mlp._src.cli.ablation import ABLATION
from jax_mlp._src.cli.sizing import Workload
from jax_mlp._src.config import OffloadConfig
from jax_mlp._src.parsing import format_bytes, parse_size
from jax_mlp._src.schedule.performance import PathSpeed
from jax_mlp._src.storage import capacity
from jax_mlp._src.storage.bandwidth import PROBE_DIRECTORY
from jax_mlp._src.storage.buffers import POOL_BYTES
from jax_mlp._src.storage.record import HEADER_SIZE

MiB = 1024**2


def plan(capsys, *args: str) -> str:
    """The output of ``jax-mlp plan ARGS``, which must succeed."""
    assert cli.main(["plan", *args]) == 0
    return capsys.readouterr().out


def figure(out: str, label: str) -> str:
    """The figure of the first row labelled ``label`` in a section of the plan (the label is 30 wide, the figure 10)."""
    line = next(line for line in out.splitlines() if line.startswith("  ") and line[2:32].rstrip() == label)
    return line[33:43].strip()


def test_a_cache_holding_the_whole_state_predicts_its_write_back_and_a_finite_time(capsys):
    # Once a ZeroDivisionError after "predicted update time: 0 s".
    out = plan(capsys, "--params", "7e9", "--paths", "nvme=5GB/s", "--nodes", "8", "--host-cache", "64GiB")
    state = 7e9 * 8 / 8  # adam's 8 B per param, over 8 nodes of one process
    records = math.ceil(state / (64 * MiB))  # OffloadConfig's 64 MiB subgroups
    write_back = records * 64 * MiB
    assert figure(out, "read during the update") == "0 B" and figure(out, "written during the update") == "0 B"
    assert figure(out, "written after the update") == format_bytes(write_back)
    assert figure(out, "I/O between updates") == plan_tables.format_seconds(write_back / 5e9)
    link_floor = state / 20e9  # to the device and back, at the default --link, both ways at once
    assert figure(out, "update") == plan_tables.format_seconds(link_floor) and link_floor > 0
    assert (
        f"predicted update time: {plan_tables.format_seconds(link_floor)}; {format_bytes(write_back)} written after"
        in out
    )
    rows = out[out.index("mechanisms") :].splitlines()[1:]
    assert len(rows) == len(ABLATION) and all(row.endswith("x") for row in rows), rows


def test_write_back_that_outlasts_the_forward_and_backward_delays_the_update(capsys):
    args = ["--params", "7e9", "--paths", "nvme=5GB/s", "--nodes", "8", "--host-cache", "64GiB", "--compute-s", "1"]
    out = plan(capsys, *args)
    write_back = math.ceil(7e9 / (64 * MiB)) * 64 * MiB / 5e9
    assert f"does not fit: the update waits {plan_tables.format_seconds(write_back - 1)} more" in out
    assert figure(out, "update") == plan_tables.format_seconds(7e9 / 20e9 + write_back - 1)
    lazy = plan(capsys, *args, "--flush", "lazy")
    # the paper's flush: dirty records wait for eviction, and this cache holds every record
    assert figure(lazy, "written after the update") == "0 B" and "fits in the forward and backward" in lazy


@pytest.mark.parametrize(
    ("text", "count"),
    [("70B", 70e9), ("7b", 7e9), ("1.5e9", 1.5e9), ("7e9", 7e9), ("4M", 4e6), ("2k", 2e3), ("1T", 1e12), ("12", 12)],
)
def test_counts_take_suffixes(text, count):
    assert command.parse_count(text, "--params") == count


@pytest.mark.parametrize("text", ["70X", "B", "-1", "0", "7 GB", ""])
def test_other_counts_are_refused(text):
    with pytest.raises(command.UsageError, match="--params"):
        command.parse_count(text, "--params")


def test_70b_is_planned(capsys):
    out = plan(capsys, "--params", "70B", "--paths", "nvme=5GB/s")
    assert out.startswith("7e+10 params, 8 B of offloaded state each")


def test_the_defaults_are_offload_configs(tmp_path):
    args = cli.build_parser().parse_args(["plan", "--params", "7B", "--paths", "nvme=5GB/s"])
    config = OffloadConfig(tmp_path)
    assert parse_size(args.subgroup_size) == config.subgroup_size
    assert parse_size(args.host_cache) == config.host_cache
    assert (args.prefetch_depth, args.write_depth, args.flush) == (
        config.prefetch_depth,
        config.write_depth,
        config.flush,
    )
    probe = cli.build_parser().parse_args(["probe", str(tmp_path)])
    assert parse_size(probe.subgroup_size) == config.subgroup_size


def test_each_section_of_a_small_run_equals_the_hand_computed_figures(capsys):
    # 1M params with an fp32 master (12 B each) over 2 processes of one node, one device each, in
    # 1 MiB subgroups; a 4 MiB host cache per node, a path reading at 1 GB/s and writing at 500 MB/s.
    args = ["--params", "1M", "--master", "--master-storage", "full", "--processes-per-node", "2"]
    args += ["--subgroup-size", "1MiB"]
    args += ["--paths", "nvme=1GB/s:500MB/s", "--host-cache", "4MiB", "--compute-s", "0.01", "--host-memory", "8GiB"]
    args += ["--prefetch-depth", "2", "--write-depth", "2"]
    out = plan(capsys, *args)
    state = 1e6 * 12 / 2  # per process
    records, cached = math.ceil(state / MiB), 2  # 6 records, 2 of them in a process's 2 MiB of cache
    assert f"{records} records of 1.0 MiB per process; prefetch_depth 2, write_depth 2, flush='idle'" in out

    params = 1e6 / 2 * 2  # bf16 (the default with --master), sharded over 2 devices
    assert figure(out, "params") == figure(out, "grads") == format_bytes(params)
    optax_adds = 1e6 / 2 * 4 + max((2 + 2) * MiB, params)  # fp32 updates + max(records on device, new params)
    assert figure(out, "update adds, optax route") == format_bytes(optax_adds)
    assert figure(out, "update adds, fused apply") == format_bytes(3 * MiB)  # computing (in, out), one staging
    assert figure(out, "peak, optax route") == format_bytes(2 * params + optax_adds)

    host = [2 * cached * MiB, 2 * (2 + 2 + 1) * MiB, 2 * min(POOL_BYTES, state), 2 * sizing.PROCESS_BYTES]
    labels = ["cache", "records in flight", "staging buffers", "process runtime"]
    assert [figure(out, label) for label in labels] == [format_bytes(nbytes) for nbytes in host]
    assert figure(out, "total") == format_bytes(sum(host))
    assert f"fits --host-memory 8.0 GiB, {format_bytes(8 * 1024**3 - sum(host))} spare" in out

    sizes = [HEADER_SIZE + MiB] * (records - 1) + [HEADER_SIZE + int(state) - (records - 1) * MiB]
    row = next(line for line in out.splitlines() if line.startswith("nvme "))
    assert row.split()[-3:] == [*format_bytes(2 * capacity.need(sizes)).split(), "-"]  # 2 processes a node

    # Alternating order: the cached records are the first of the step, then the write_depth=2 whose writes ran
    # on past the last update, taken from memory; this update's last 2 writes run on past it.
    run_on = 2
    reads = writes = records - cached - run_on
    assert figure(out, "read during the update") == figure(out, "written during the update") == "2.0 MiB"
    assert figure(out, "written after the update") == format_bytes((cached + run_on) * MiB)
    ahead = min(reads, 2)  # prefetch_depth reads moved to the idle time before the update
    busy = 2 * ((reads - ahead) * MiB / 1e9 + writes * MiB / 5e8)  # 2 processes take turns on the path
    idle = 2 * MiB * ((cached + run_on) / 5e8 + ahead / 1e9)
    assert figure(out, "I/O between updates") == plan_tables.format_seconds(idle)
    update = busy + max(MiB / 5e8, idle - 0.01)  # + the idle I/O past the 10 ms, the last write's drain among it
    assert figure(out, "update") == plan_tables.format_seconds(update)
    assert figure(out, "step, split") == plan_tables.format_seconds(0.01 + update)


def test_json_holds_the_figures_of_the_tables(capsys):
    args = ["--params", "1M", "--master", "--subgroup-size", "1MiB", "--paths", "nvme=1GB/s:500MB/s", "pfs=200MB/s"]
    args += ["--host-cache", "4MiB", "--compute-s", "0.01", "--processes-per-node", "2"]
    out = plan(capsys, *args)
    figures = json.loads(plan(capsys, *args, "--json"))
    update, step = figures["update"], figures["step"]
    assert plan_tables.format_seconds(update["seconds"]) == figure(out, "update")
    assert format_bytes(update["bytes_read"]) == figure(out, "read during the update")
    assert format_bytes(update["idle_write_bytes"]) == figure(out, "written after the update")
    assert plan_tables.format_seconds(step["overlapped_s"]) == figure(out, "step, overlapped")
    assert format_bytes(figures["device"]["fused_apply"]) == figure(out, "update adds, fused apply")
    assert format_bytes(figures["host"]["total"]) == figure(out, "total")
    assert f"{figures['records']} records of {format_bytes(figures['record_bytes'])} per process" in out
    for path in figures["paths"]:
        row = next(line for line in out.splitlines() if line.startswith(f"{path['name']} "))
        assert (
            row.split()[1] == f"{path['share']:.1%}"
            and row.split()[-3:-1] == format_bytes(path["needs_per_node"]).split()
        )
    assert [m["name"] for m in figures["mechanisms"]] == [v.name for v in ABLATION]
    assert figures["mechanisms"][-1]["seconds"] == update["seconds"]
    assert figures["mechanisms"][0]["multipath"] is False and len(figures["mechanisms"][0]["bytes_read"]) == 1


def test_update_compute_s_replaces_the_link_floor(capsys):
    whole = ["--params", "7e9", "--paths", "nvme=5GB/s", "--nodes", "8", "--host-cache", "64GiB", "--json"]
    floor = json.loads(plan(capsys, *whole))["update"]
    assert floor["seconds"] == floor["link_floor_s"] > 0  # every record cached: the update is its compute
    given = json.loads(plan(capsys, *whole, "--update-compute-s", "3"))["update"]
    assert given["seconds"] == 3.0 and given["link_floor_s"] == floor["link_floor_s"]


def test_a_bf16_master_is_planned_whole_unless_stored_as_its_remainder(capsys):
    common = ["--params", "1M", "--master", "--paths", "nvme=5GB/s"]
    assert "1e+06 params, 12 B of offloaded state each" in plan(capsys, *common)
    assert "1e+06 params, 10 B of offloaded state each" in plan(capsys, *common, "--master-storage", "remainder")
    remainder_fp16 = ("--master-storage", "remainder", "--param-dtype", "fp16")
    assert "1e+06 params, 12 B of offloaded state each" in plan(capsys, *common, *remainder_fp16)


def test_device_memory_matches_the_measured_ratios_of_efficiency_md():
    # docs/efficiency.md: 64 MiB of bf16 params in 8 MiB subgroups with an fp32 master: the optax route
    # added 3.0x the params (4.0x on the first step), the fused apply 0.33-0.375x, whatever write_depth.
    params = 64 * MiB / 2
    for write_depth in (1, 4):
        work = Workload(params, 2, 4, 12, 1, 1, 1, 8 * MiB, 2, write_depth)
        device = sizing.device_memory(work)
        assert device.optax_route / device.params == 3.0 and device.fused_apply / device.params == 0.375


def test_the_forward_and_backward_from_flops(capsys):
    out = plan(capsys, "--params", "1B", "--paths", "nvme=5GB/s", "--processes-per-node", "2")
    assert "not given" in out and "step: this plus the forward and backward" in out
    args = ["--params", "1B", "--paths", "nvme=5GB/s", "--processes-per-node", "2", "--tflops", "100"]
    out = plan(capsys, *args, "--tokens-per-step", "1M", "--mfu", "0.5")
    seconds = 6 * 1e9 * 1e6 / (2 * 100e12 * 0.5)
    assert (
        figure(out, "forward + backward") == plan_tables.format_seconds(seconds) == "60 s" and "estimated: 6 x" in out
    )


def test_host_memory_over_the_node_is_a_warning(capsys):
    out = plan(capsys, "--params", "7B", "--paths", "nvme=5GB/s", "--host-cache", "100GiB", "--host-memory", "32GiB")
    assert "WARNING: over --host-memory 32.0 GiB" in out
    config = OffloadConfig("/unused")
    in_flight = config.prefetch_depth + config.write_depth + 1
    room = 32 * 1024**3 - in_flight * 64 * MiB - POOL_BYTES - sizing.PROCESS_BYTES  # all but the cache
    assert f"the largest --host-cache that fits: {format_bytes(room)}" in out


def test_directories_in_paths_are_probed_like_jax_mlp_probe(tmp_path, capsys):
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    fast.mkdir(), slow.mkdir()
    out = plan(capsys, "--params", "1M", "--paths", str(fast), f"{slow},pfs=1GB/s", "--probe-size", "2MiB")
    for directory in (fast, slow):
        assert f"probed {directory}: read " in out
        row = next(line for line in out.splitlines() if line.startswith(f"{directory} "))
        assert row.split()[-1] == "GiB", row  # its free space: a directory here
        assert not os.path.exists(directory / PROBE_DIRECTORY)
    assert any(line.startswith("pfs ") for line in out.splitlines())
    assert cli.main(["plan", "--params", "1M", "--paths", str(fast), "--probe-size", "2MiB", "--json"]) == 0
    printed = capsys.readouterr()  # with --json, stdout is the JSON alone; the probe's line goes to stderr
    assert json.loads(printed.out)["paths"][0]["name"] == str(fast) and f"probed {fast}: read " in printed.err


def test_rates_are_read_first_in_probe_and_in_plan(tmp_path, capsys):
    assert speeds.declared_speed("nvme=4GB/s:1GB/s") == PathSpeed("nvme", 4e9, 1e9)
    assert speeds.declared_speed("nvme=4GB/s") == PathSpeed("nvme", 4e9, 4e9)
    assert cli.main(["probe", str(tmp_path), "--size", "2MiB", "--record", "1MiB"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["path", "read", "write"]
    read, write = (float(figure) * 1e6 for figure in lines[1].split()[1:5:2])
    (pasted,) = lines[-1].removeprefix("for jax-mlp plan elsewhere: --paths ").split(",")
    speed = speeds.declared_speed(pasted)
    duplex = lines[1].split()[5] == "duplex"  # what "both at once" says; the pasted entry carries it
    assert speed == PathSpeed(str(tmp_path), read, write, 0.0 if duplex else 1.0)


def test_probe_json_holds_each_paths_measurement_free_space_and_need(tmp_path, capsys):
    args = ["probe", str(tmp_path), "--size", "2MiB", "--record", "1MiB", "--json"]
    assert cli.main(args) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["path"] == str(tmp_path) and row["nbytes"] == 2 * (HEADER_SIZE + MiB) and 0 <= row["serial"] <= 1
    assert row["read_bandwidth"] > 0 and row["write_bandwidth"] > 0 and row["free"] > 0 and row["needs"] is None
    assert cli.main([*args, "--state", "4MiB", "--subgroup-size", "1MiB"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["needs"] >= 2 * 4 * MiB  # two slots of each record


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--params", "0"], "must be positive"),
        (["--params", "1B", "--nodes", "0"], "--nodes must be at least 1"),
        (["--params", "1B", "--contention", "0"], "--contention must be in (0, 1]"),
        (["--params", "1B", "--tflops", "300"], "--tokens-per-step"),
        (["--params", "1B", "--tflops", "300", "--compute-s", "1"], "not both"),
        (["--params", "1B", "--paths", "/no/such/dir"], "neither a directory here nor NAME=RATE"),
        (["--params", "1B", "--update-compute-s", "-1"], "--update-compute-s must not be negative"),
        ([], "give the model's size as --params (e.g. 7B) or its leaves as --leaves"),
        (["--leaves", "2048x0"], "--leaves '2048x0' is not a leaf's shape"),
        (["--leaves", "2048:x"], "--leaves '2048:x' is not a leaf's shape"),
        (["--params", "1B", "--leaves", "1024x1024"], "--params 1B is not the 1048576 params of --leaves"),
    ],
)
def test_mistakes_are_one_line_and_status_2(args, message, capsys):
    paths = [] if "--paths" in args else ["--paths", "nvme=5GB/s"]
    assert cli.main(["plan", *args, *paths]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("jax-mlp plan: error:") and message in error and len(error.splitlines()) == 1, error


def test_a_layer_streamed_plan_adds_the_grads_each_way_when_the_update_is_deferred(capsys):
    """``--params-in tiers``: the step's bytes are ``streamed_bytes``'s (the formula the library's own counts meet,
    ``tests/test_layers.py``), each path's share of them; ``--clipping defer`` adds the grads, the params' bytes,
    and its forward reads the first layer, which a speculated update's forward takes as the update made it."""
    from jax_mlp._src.cli.streamed import streamed_bytes

    node = ["--params", "175B", "--master", "--params-in", "tiers", "--layers", "96", "--processes-per-node", "4"]
    node += ["--paths", "nvme=6.5GB/s:3GB/s", "lustre=3GB/s:2GB/s", "--host-cache", "200GiB", "--compute-s", "60"]
    said = {}
    for clipping in ("speculate", "defer"):
        out = plan(capsys, *node, "--clipping", clipping)
        said[clipping] = [
            parse_size(re.search(rf"{part} ([\d.]+ \w+) \(", out).group(1)) for part in ("reads", "writes")
        ]
        assert "predicted step" in out
    params = parse_size(re.search(r"params records ([\d.]+ \w+),", out).group(1))
    state = parse_size(re.search(r"state records ([\d.]+ \w+) per", out).group(1))
    cache, layer = parse_size("200GiB") / 4, params / 96  # the cache per process
    speculated = streamed_bytes(params, state, cache, layer, kept_bytes=layer)  # the first layer from the update
    deferred = streamed_bytes(params, state, cache, layer, grads_bytes=params)  # read by the forward to update it
    assert said["speculate"] == pytest.approx(speculated, rel=1e-3)
    assert said["defer"] == pytest.approx(deferred, rel=1e-3)
    assert deferred[1] == speculated[1] + params and deferred[0] > speculated[0] + params


def test_the_models_own_leaves_are_packed_as_mlp_offload_packs_them(capsys):
    # 8 leaves of 2048x2048 with fp32 masters: 48 MiB of state each, so 8 records where 64 MiB cuts would make 6
    paths = ["--paths", "nvme=300MB/s:300MB/s:duplex", "--master"]
    figures = json.loads(plan(capsys, "--leaves", "2048x2048:8", *paths, "--json"))
    assert (figures["records"], figures["record_bytes"]) == (8, 48 * MiB)
    assert figures["params"] == 8 * 2048 * 2048
    cut = json.loads(plan(capsys, "--params", str(8 * 2048 * 2048), *paths, "--json"))
    assert (cut["records"], cut["record_bytes"]) == (6, 64 * MiB)
    # a leaf above the subgroup size is cut into row chunks; small leaves share a record; --params may agree
    mixed = ["--leaves", "8192x2048", "2048:8", "--params", str(8192 * 2048 + 8 * 2048), "--subgroup-size", "64MiB"]
    figures = json.loads(plan(capsys, *mixed, *paths, "--json"))
    assert figures["records"] == 4  # 192 MiB of state in three 64 MiB chunks, then the biases
    # (4, 4) with (4,): 160 B of 192; (8, 4) is 256 B, cut at 6 rows (192 B) and 2 (64 B)
    assert sizing.packed_records([(4, 4), (4,), (8, 4)], 8.0, 192) == 3
