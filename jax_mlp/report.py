"""Plots of a ``log_to`` file, as a public namespace: what ``jax-mlp report`` draws, from Python.

Needs matplotlib (``pip install "jax_mlp[report]"``). See docs/api.md#the-jax-mlp-command.
"""

from jax_mlp._src.cli.plots import LogError, Update, load_log, make_figure, write_report

__all__ = ["LogError", "Update", "load_log", "make_figure", "write_report"]
