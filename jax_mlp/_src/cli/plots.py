"""Plots of a telemetry log written by ``mlp_offload(..., log_to="run.jsonl")``.

:func:`load_log` reads the log, :func:`make_figure` draws it on a matplotlib ``Figure`` (one panel
per question: where did one update's time go, where does the time go over the run, how fast is each
path, where do the subgroups live, how well does the cache work), and :func:`write_report` does both
and saves the figure. ``jax-mlp report`` is the command-line face. Needs matplotlib
(``pip install "jax_mlp[report]"``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

from matplotlib.figure import Figure

from jax_mlp._src.stats import BUSY, BYTES, EVENT_KINDS, LOG_REQUIRED, PER_PATH, IOEvent

TIMELINE = "Timeline of one update"
TIME_PER_UPDATE = "Time per update"
THROUGHPUT = "Throughput per path"
PLACEMENT = "Placement: subgroups per path"
CACHE = "Host cache"
PANELS = (TIMELINE, TIME_PER_UPDATE, THROUGHPUT, PLACEMENT, CACHE)
BETWEEN = "Between updates"


class LogError(ValueError):
    """A telemetry log that cannot be used: missing, unreadable, not JSON lines, or lacking a field."""


class Update(NamedTuple):
    """One line of the log: the statistics of one ``init`` (step 0) or ``update``.

    Attributes:
      step: the step the call produced.
      seconds: its wall time.
      read_wait_s: time waiting on reads.
      compute_s: time dispatching the inner updates.
      write_wait_s: time waiting on writes.
      cache_hits: subgroups served by the host cache.
      cache_misses: subgroups read from a path.
      paths: the storage paths, in order.
      per_path: for each of ``bytes_read``, ``bytes_written``, ``read_busy_s``, ``write_busy_s`` and
        ``placement`` (the writer's ``stats.PER_PATH``), the value per path.
      events: the timed reads, computes and writes, relative to the start of the call.
      bandwidth: the scheduler's estimate per path after the call (``{"read": bytes/s, "write": bytes/s}``:
        declared, probed, capped or measured while running), if the log has one.
      moves: subgroups the scheduler moved after the call (0 in logs from before it was logged).
      fallback: whether the scheduler had fallen back to the fastest path alone.
    """

    step: int
    seconds: float
    read_wait_s: float
    compute_s: float
    write_wait_s: float
    cache_hits: int
    cache_misses: int
    paths: list[str]
    per_path: dict[str, dict[str, float]]
    events: list[IOEvent]
    bandwidth: dict[str, dict[str, float]]
    moves: int = 0
    fallback: bool = False


def _parse_line(line: Any, where: str) -> Update:
    if not isinstance(line, dict):
        raise LogError(f"{where} is not a JSON object")
    missing = [key for key in LOG_REQUIRED if key not in line]
    paths = line.get("paths", [])
    if not isinstance(paths, list):
        raise LogError(f"{where} has 'paths' {paths!r}, not a list of paths")
    missing += [f"{name}[{path}]" for name in PER_PATH for path in paths if f"{name}[{path}]" not in line]
    if missing:
        raise LogError(
            f"{where} lacks {', '.join(repr(m) for m in missing[:3])}: it is not a line written by "
            "mlp_offload(..., log_to=...)"
        )
    try:
        return Update(
            step=int(line["step"]),
            seconds=float(line["seconds"]),
            read_wait_s=float(line["read_wait_s"]),
            compute_s=float(line["compute_s"]),
            write_wait_s=float(line["write_wait_s"]),
            cache_hits=int(line["cache_hits"]),
            cache_misses=int(line["cache_misses"]),
            paths=list(paths),
            per_path={name: {path: float(line[f"{name}[{path}]"]) for path in paths} for name in PER_PATH},
            events=[
                IOEvent(kind, None if index is None else paths[index], int(subgroup), float(start), float(end))
                for kind, index, subgroup, start, end in line.get("events", [])
            ],
            bandwidth=dict(line.get("bandwidth") or {}),
            moves=int(line.get("moves", 0)),
            fallback=bool(line.get("fallback", False)),
        )
    except (TypeError, ValueError, IndexError) as error:
        raise LogError(f"{where} has a malformed value ({error})") from None


def load_log(path: str | os.PathLike) -> list[Update]:
    """Reads a ``log_to`` file.

    Args:
      path: the JSON-lines file.

    Returns:
      One :class:`Update` per line, in the file's order.

    Raises:
      LogError: naming the file (and line), if it is missing, unreadable, empty, or a line is not
        one that ``log_to`` writes.
    """
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise LogError(f"{name} does not exist; write it with mlp_offload(..., log_to={name!r})") from None
    except (OSError, UnicodeDecodeError) as error:
        raise LogError(f"{name} cannot be read ({getattr(error, 'strerror', None) or error})") from None
    lines = text.splitlines()
    updates = []
    for number, content in enumerate(lines, start=1):
        if not content.strip():
            continue
        try:
            line = json.loads(content)
        except json.JSONDecodeError as error:
            if number == len(lines) and not text.endswith("\n"):
                break  # the line a running training is writing right now
            raise LogError(f"line {number} of {name} is not JSON ({error.msg} at column {error.colno})") from None
        updates.append(_parse_line(line, f"line {number} of {name}"))
    if not updates:
        raise LogError(f"{name} has no lines; it fills as mlp_offload(..., log_to=...) runs init and update")
    return updates


def _short(path: str, width: int = 40) -> str:
    """``path`` in at most ``width`` characters: a store's URL keeps its scheme and bucket, a directory its end."""
    if len(path) <= width:
        return path
    scheme, found, rest = path.partition("://")
    if not found:
        return "…" + path[-(width - 1) :]
    head = f"{scheme}://{rest.split('/', 1)[0]}/"[: width // 2]
    return head + "…" + path[-(width - len(head) - 1) :]


def _lanes(paths: Sequence[str]) -> list[tuple[str, str | None, str]]:
    """The timeline's rows, top to bottom: (kind, path, label)."""
    lanes = []
    for kind in EVENT_KINDS:
        if kind == "compute":
            lanes.append((kind, None, "compute"))
        else:
            lanes.extend((kind, path, f"{kind} p{i}") for i, path in enumerate(paths))
    return lanes


def _draw_lanes(ax: Any, update: Update, lanes: list[tuple[str, str | None, str]]) -> None:
    colors = {path: f"C{i}" for i, path in enumerate(update.paths)}
    for row, (kind, path, _) in enumerate(lanes):
        spans = [(e.start * 1e3, (e.end - e.start) * 1e3) for e in update.events if e.kind == kind and e.path == path]
        color = "0.35" if kind == "compute" else colors[path]
        ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=color, alpha=0.55 if kind == "write" else 0.9)
    ax.set_yticks(range(len(lanes)), [label for *_, label in lanes])


def _draw_timeline(figure: Figure, spec: Any, update: Update) -> None:
    """The lanes of one update; I/O done before it (between updates) gets its own axes on the left.

    The gap between the two is the forward and backward pass, which would otherwise squash the
    update into a sliver.
    """
    lanes = _lanes(update.paths)
    before = [e for e in update.events if e.start < 0]
    end_ms = update.seconds * 1e3
    if before:
        left_spec, right_spec = spec.subgridspec(1, 2, width_ratios=(1, 4), wspace=0.02)
        left = figure.add_subplot(left_spec)
        ax = figure.add_subplot(right_spec, sharey=left)
        _draw_lanes(left, update, lanes)
        first, last = min(e.start for e in before) * 1e3, min(max(e.end for e in before) * 1e3, 0.0)
        pad = max(last - first, 1e-3) * 0.05
        left.set_xlim(first - pad, last + pad)
        left.set_xlabel("ms before the call")
        left.set_title(f"{BETWEEN} ({len(before)} events)")
        left.invert_yaxis()
        ax.tick_params(labelleft=False)
    else:
        ax = figure.add_subplot(spec)
        ax.invert_yaxis()
    _draw_lanes(ax, update, lanes)
    ax.set_xlim(-0.02 * end_ms, 1.02 * end_ms)
    ax.axvline(0, color="k", lw=0.8)
    ax.axvline(end_ms, color="k", lw=0.8, ls="--")
    ax.set_xlabel("ms from the start of the call (dashed: its end)")
    what = "init" if update.step == 0 else f"the update to step {update.step}"
    during = len(update.events) - len(before)
    ax.set_title(f"{TIMELINE}: {what}, {end_ms:.1f} ms ({during} events; bars: reads, compute dispatch, writes)")


def _draw_time_per_update(ax: Any, updates: Sequence[Update]) -> None:
    steps = [u.step for u in updates]
    parts = {
        "waiting on reads": [u.read_wait_s * 1e3 for u in updates],
        "computing (dispatch)": [u.compute_s * 1e3 for u in updates],
        "waiting on writes": [u.write_wait_s * 1e3 for u in updates],
    }
    parts["other"] = [max(u.seconds * 1e3 - sum(p[i] for p in parts.values()), 0.0) for i, u in enumerate(updates)]
    bottom = [0.0] * len(updates)
    for label, values in parts.items():
        ax.bar(steps, values, bottom=bottom, width=1.0, label=label, linewidth=0)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    # The first calls compile; keep them from flattening the rest of the run.
    top = 1.25 * sorted(bottom)[int(0.95 * (len(bottom) - 1))]
    clipped = [(step, total) for step, total in zip(steps, bottom, strict=True) if total > top]
    if clipped and top > 0:
        ax.set_ylim(0, top)
        listed = ", ".join(f"{step}: {total:,.0f} ms" for step, total in clipped[:2])
        more = f" and {len(clipped) - 2} more" if len(clipped) > 2 else ""
        ax.set_xlabel(f"step (off the scale: step {listed}{more})")
    else:
        ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.legend(fontsize="small", loc="upper right")
    ax.set_title(TIME_PER_UPDATE)


def _rate(nbytes: float, busy: float) -> float:
    return nbytes / busy / 1e6 if busy > 0 else float("nan")


def _smooth(values: Sequence[float], window: int) -> list[float]:
    """A centred moving average that skips NaNs (steps without any transfer on the path)."""
    smoothed = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window // 2) : i + window // 2 + 1] if v == v]
        smoothed.append(sum(chunk) / len(chunk) if chunk else float("nan"))
    return smoothed


def _draw_throughput(ax: Any, updates: Sequence[Update]) -> None:
    """Each path's measured rate per direction (solid: read, dotted: write) and the scheduler's estimate (dashed)."""
    steps = [u.step for u in updates]
    paths = updates[-1].paths
    window = max(1, len(updates) // 25)
    for i, path in enumerate(paths):
        for kind, style in (("read", "-"), ("write", ":")):
            rates = [
                _rate(u.per_path[BYTES[kind]].get(path, 0.0), u.per_path[BUSY[kind]].get(path, 0.0)) for u in updates
            ]
            estimates = [u.bandwidth.get(path, {}).get(kind, float("nan")) / 1e6 for u in updates]
            known = [e for e in estimates if e == e]
            reference, what = (
                (known[-1], "estimate") if known else (max((r for r in rates if r == r), default=0), "max")
            )
            label = f"p{i} {kind} ({what} {reference:,.0f})"
            if window > 1:
                ax.plot(steps, rates, style, color=f"C{i}", lw=0.6, alpha=0.3)
            ax.plot(steps, _smooth(rates, window), style, color=f"C{i}", lw=1.6, label=label)
            if known:
                ax.plot(steps, estimates, "--", color=f"C{i}", lw=0.8, alpha=0.6, drawstyle="steps-post")
    ax.set_xlabel("step")
    ax.set_ylabel(f"MB/s while busy{f' (mean of {window} steps)' if window > 1 else ''}")
    ax.legend(
        fontsize="small", ncols=2, title="dashed: the scheduler's estimate, else the best seen", title_fontsize="small"
    )
    last = updates[-1].bandwidth
    estimates = ", ".join(
        f"p{i} {last[path]['read'] / 1e6:,.0f}/{last[path]['write'] / 1e6:,.0f}"
        for i, path in enumerate(paths)
        if path in last
    )
    ax.set_title(f"{THROUGHPUT} (estimated read/write MB/s: {estimates})" if estimates else THROUGHPUT)


def _draw_placement(ax: Any, updates: Sequence[Update]) -> None:
    """Subgroups stored on each path, the subgroups each rebalancing moved, and when it fell back to one path."""
    steps = [u.step for u in updates]
    paths = updates[-1].paths
    counts = [[u.per_path["placement"].get(path, 0.0) for u in updates] for path in paths]
    ax.stackplot(steps, counts, labels=[f"p{i}" for i in range(len(paths))], step="post", alpha=0.8)
    moves = [u.moves for u in updates]
    ax.bar(steps, moves, width=0.8, color="k", label="moved after the step")
    fallback = next((u.step for u in updates if u.fallback), None)
    fell_back = "" if fallback is None else f", fell back to the fastest path after step {fallback}"
    if fallback is not None:
        ax.axvline(fallback, color="r", ls="--", label="fell back to the fastest path")
    ax.set_xlabel("step")
    ax.set_ylabel("subgroups")
    ax.legend(fontsize="small", loc="lower right")
    moving = sum(1 for m in moves if m)
    ax.set_title(f"{PLACEMENT} ({sum(moves)} moved in {moving} of {len(updates)} steps{fell_back})")


def _draw_cache(ax: Any, updates: Sequence[Update]) -> None:
    steps = [u.step for u in updates]
    ax.plot(steps, [u.cache_hits for u in updates], label="hits (no read)", color="C2")
    ax.plot(steps, [u.cache_misses for u in updates], label="misses (read from a path)", color="C3")
    ax.set_xlabel("step")
    ax.set_ylabel("subgroups per update")
    ax.legend(fontsize="small")
    ax.set_title(CACHE)


def make_figure(updates: Sequence[Update], *, step: int | None = None) -> Figure:
    """Draws the report: the timeline of one update, then the whole run.

    Args:
      updates: the log, from :func:`load_log`.
      step: the step whose update the timeline shows; None for the last line's.

    Returns:
      The figure, with one axes per panel, titled as in ``PANELS`` (the timeline's title goes on to
      name the update).

    Raises:
      LogError: if ``updates`` is empty or no line has ``step``.
    """
    if not updates:
        raise LogError("the log has no lines to plot")
    if step is None:
        chosen = updates[-1]
    else:
        chosen = next((u for u in reversed(updates) if u.step == step), None)
        if chosen is None:
            raise LogError(f"the log has no line for step {step}; it has steps {updates[0].step} to {updates[-1].step}")
    figure = Figure(figsize=(13, 13), layout="constrained")
    grid = figure.add_gridspec(3, 2, height_ratios=(1.1, 1, 1))
    _draw_timeline(figure, grid[0, :], chosen)
    _draw_time_per_update(figure.add_subplot(grid[1, 0]), updates)
    _draw_throughput(figure.add_subplot(grid[1, 1]), updates)
    _draw_placement(figure.add_subplot(grid[2, 0]), updates)
    _draw_cache(figure.add_subplot(grid[2, 1]), updates)
    names = "    ".join(f"p{i} = {_short(path)}" for i, path in enumerate(chosen.paths))
    figure.suptitle(
        f"jax_mlp offload report: {len(updates)} calls, steps {updates[0].step}–{updates[-1].step}\n{names}"
    )
    return figure


def write_report(log: str | os.PathLike, output: str | os.PathLike, *, step: int | None = None) -> Figure:
    """Reads ``log``, draws it with :func:`make_figure` and saves the figure to ``output``.

    Args:
      log: the ``log_to`` file.
      output: the image to write; its extension picks the format (``.png``, ``.pdf``, ``.svg``).
      step: the step whose update the timeline shows; None for the last.

    Returns:
      The saved figure.

    Raises:
      LogError: for an unusable log or step, or an output that cannot be written.
    """
    figure = make_figure(load_log(log), step=step)
    try:
        figure.savefig(output, dpi=100)
    except (OSError, ValueError) as error:
        raise LogError(f"cannot write {os.fspath(output)}: {getattr(error, 'strerror', None) or error}") from None
    return figure
