"""``cli/plots.py``, ``cli/report_command.py`` and the ``StatsLog`` of ``stats.py``: ``log_to`` writes one JSON line
per call; ``jax-mlp report`` turns a real log into a PNG.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import optax
import pytest
from helpers import grads_at, make_params, train

import jax_mlp
from jax_mlp import report
from jax_mlp._src.cli import main as cli
from jax_mlp._src.cli import plots
from jax_mlp._src.stats import busy_seconds

STEPS = 6
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real offloaded run over two paths with a small cache, logged with ``log_to``."""
    directory = tmp_path_factory.mktemp("telemetry")
    log = directory / "run.jsonl"
    params = make_params()
    with jax_mlp.mlp_offload(
        optax.adam(1e-2),
        paths=[directory / "a", directory / "b"],
        subgroup_size="16KiB",
        host_cache="48KiB",
        log_to=log,
    ) as tx:
        train(tx, params, tx.init(params), range(STEPS))
        num_subgroups = len(tx.plan.subgroups)
        paths = tx.stats.paths
    return log, num_subgroups, paths


def test_log_has_one_line_per_call_with_per_path_figures_and_events(run):
    log, num_subgroups, paths = run
    lines = [json.loads(text) for text in log.read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(STEPS + 1))  # init, then each update
    for line in lines:
        assert line["paths"] == paths
        for key in ("seconds", "read_wait_s", "compute_s", "write_wait_s", "cache_hits", "cache_misses", "time"):
            assert isinstance(line[key], (int, float)), key
        for path in paths:
            for name in ("bytes_read", "bytes_written", "read_busy_s", "write_busy_s", "placement"):
                assert f"{name}[{path}]" in line
    for line in lines[1:]:
        events = line["events"]
        kinds = {kind for kind, *_ in events}
        assert kinds <= {"read", "compute", "write"} and "compute" in kinds and "read" in kinds
        assert sum(kind == "compute" for kind, *_ in events) == num_subgroups
        assert sum(kind == "read" for kind, *_ in events) == line["cache_misses"]
        assert line["cache_hits"] + line["cache_misses"] == num_subgroups
        assert all(start <= end for *_, start, end in events)
        for index, path in enumerate(paths):
            reads = [(s, e) for kind, i, _, s, e in events if kind == "read" and i == index]
            assert line[f"read_busy_s[{path}]"] == pytest.approx(busy_seconds(reads), abs=1e-5)
            assert (line[f"bytes_read[{path}]"] > 0) == bool(reads)
        assert sum(line[f"placement[{path}]"] for path in paths) == num_subgroups
    assert all(line[f"bytes_read[{path}]"] > 0 for path in paths for line in lines[2:])


def test_busy_seconds_is_the_length_of_the_union():
    assert busy_seconds([]) == 0
    assert busy_seconds([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)


def test_report_figure_has_the_panels_and_the_png_is_valid(run, tmp_path, capsys):
    log, _, paths = run
    figure = report.make_figure(report.load_log(log))
    titles = [ax.get_title() for ax in figure.axes]
    for panel in plots.PANELS:
        assert sum(title.startswith(panel) for title in titles) == 1, (panel, titles)
    assert all(title.startswith((*plots.PANELS, plots.BETWEEN)) for title in titles), titles

    def panel(name):
        return next(ax for ax in figure.axes if ax.get_title().startswith(name))

    timeline, throughput, placement = panel(plots.TIMELINE), panel(plots.THROUGHPUT), panel(plots.PLACEMENT)
    assert f"step {STEPS}" in timeline.get_title()
    lanes = timeline.yaxis.get_major_formatter().format_ticks(timeline.get_yticks())
    assert lanes == ["read p0", "read p1", "compute", "write p0", "write p1"]
    assert all(len(bars.get_paths()) > 0 for bars in timeline.collections[:3])  # reads on each path, compute
    legend = sorted(t.get_text().split(" (")[0] for t in throughput.get_legend().get_texts())
    assert legend == ["p0 read", "p0 write", "p1 read", "p1 write"]
    assert len(placement.collections) == len(paths)

    output = tmp_path / "report.png"
    assert cli.main(["report", str(log), "-o", str(output), "--step", "3"]) == 0
    assert "Time per update" in capsys.readouterr().out
    data = output.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert (width, height) == (1300, 1300)
    assert len(data) > 50_000  # five drawn panels, not an empty canvas


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist"),
        ("", "has no lines"),
        ("\n\nnot json\n", "line 3 of"),
        ("[1, 2]\n", "is not a JSON object"),
        ('{"step": 0, "seconds": 1}\n', "lacks"),
        ("{truncated\n", "is not JSON"),
    ],
)
def test_report_user_mistakes_are_one_line_and_status_2(tmp_path, capsys, content, message):
    log = tmp_path / "run.jsonl"
    if content is not None:
        log.write_text(content)
    assert cli.main(["report", str(log), "-o", str(tmp_path / "out.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jax-mlp report: error: ") and message in err, err
    assert not (tmp_path / "out.png").exists()


def test_report_of_a_missing_step_or_unwritable_output_is_one_line(run, tmp_path, capsys):
    log, _, _ = run
    assert cli.main(["report", str(log), "--step", "999"]) == 2
    assert "no line for step 999" in capsys.readouterr().err
    assert cli.main(["report", str(log), "-o", str(tmp_path / "missing" / "dir" / "out.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write" in err


def test_a_log_being_written_is_read_up_to_its_last_complete_line(run, tmp_path, capsys):
    log, _, _ = run
    text = log.read_text()
    partial = tmp_path / "partial.jsonl"
    partial.write_text(text + text.splitlines()[-1][:40])  # a line still being written
    assert len(report.load_log(partial)) == STEPS + 1
    bad = json.loads(text.splitlines()[-1]) | {"step": "seven"}
    partial.write_text(text + json.dumps(bad) + "\n")
    assert cli.main(["report", str(partial)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"line {STEPS + 2} of" in err and "malformed value" in err


def test_the_command_runs_as_a_module_with_help_and_one_line_errors(tmp_path):
    command = [sys.executable, "-m", "jax_mlp"]
    helped = subprocess.run([*command, "report", "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "log_to" in helped.stdout and "--output" in helped.stdout
    failed = subprocess.run(
        [*command, "report", str(tmp_path / "nope.jsonl")], capture_output=True, text=True, timeout=120
    )
    assert failed.returncode == 2
    assert failed.stderr.count("\n") == 1 and "does not exist" in failed.stderr and "Traceback" not in failed.stderr


def test_log_to_restarts_a_fresh_run_appends_on_resume_and_survives_a_failing_callback(tmp_path):
    log = tmp_path / "run.jsonl"
    log.write_text("stale line of an older run\n")
    params = make_params()

    def broken(stats):
        raise RuntimeError("the user's logger is down")

    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[tmp_path / "a"], log_to=log, on_stats=broken) as tx:
        state = tx.init(params)
        tx.update(grads_at(params, 0), state, params)
    assert [json.loads(text)["step"] for text in log.read_text().splitlines()] == [0, 1]

    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[tmp_path / "a"], log_to=log, resume=True) as tx:
        state = tx.init(params)
        tx.update(grads_at(params, 1), state, params)
    assert [json.loads(text)["step"] for text in log.read_text().splitlines()] == [0, 1, 2]

    with pytest.raises(jax_mlp.OffloadError, match="log_to"):
        jax_mlp.mlp_offload(optax.adam(1e-2), paths=[tmp_path / "b"], log_to=tmp_path / "no" / "such" / "dir.jsonl")
