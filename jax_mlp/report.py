"""Plots of a ``log_to`` file, as a public namespace: what ``jax-mlp report`` draws, from Python.

Needs matplotlib (``pip install "jax_mlp[report]"``). See docs/api.md#the-jax-mlp-command.
"""

from jax_mlp._src.cli.plots import (
    BETWEEN,
    CACHE,
    PANELS,
    PLACEMENT,
    THROUGHPUT,
    TIME_PER_UPDATE,
    TIMELINE,
    LogError,
    Update,
    load_log,
    make_figure,
    write_report,
)

__all__ = [
    "BETWEEN",
    "CACHE",
    "PANELS",
    "PLACEMENT",
    "THROUGHPUT",
    "TIMELINE",
    "TIME_PER_UPDATE",
    "LogError",
    "Update",
    "load_log",
    "make_figure",
    "write_report",
]
