"""What a sub-command of ``jax-mlp`` is, and the argument parsing the sub-commands share.

Each sub-command is a module with a ``handle(args) -> exit status`` function and one :class:`Command`
that names it, explains it and lists its arguments; :mod:`~jax_mlp._src.cli.main` collects them. A
user mistake (a missing file, a malformed value) is raised as :class:`UsageError` and printed as one
line, with exit status 2.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any, NamedTuple

from jax_mlp._src.config import OffloadConfig
from jax_mlp._src.parsing import parse_rate

PROG = "jax-mlp"
DEFAULTS = OffloadConfig.defaults()
"""``OffloadConfig``'s defaults: ``plan`` and ``probe`` start from the same subgroup size and depths as a run."""
_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBtT]?)\s*$")
_COUNT_SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


class UsageError(Exception):
    """A mistake in the command line or in the files it names: one line on stderr, exit status 2."""


class Argument(NamedTuple):
    """One ``add_argument`` call: its flags (or positional name) and keyword options."""

    flags: tuple[str, ...]
    options: dict[str, Any]


def argument(*flags: str, **options: Any) -> Argument:
    """An argument of a sub-command, written as for ``argparse.ArgumentParser.add_argument``."""
    return Argument(flags, options)


class Command(NamedTuple):
    """A sub-command.

    Attributes:
      name: what the user types after ``jax-mlp``.
      handle: called with the parsed arguments; returns the exit status; raises :class:`UsageError`
        for user mistakes.
      summary: one line for ``jax-mlp --help``.
      description: the text of ``jax-mlp NAME --help``, with an example.
      arguments: the sub-command's arguments.
    """

    name: str
    handle: Callable[[argparse.Namespace], int]
    summary: str
    description: str
    arguments: tuple[Argument, ...] = ()


def rate(text: str, what: str) -> float:
    """A rate the user typed (``5GB/s``), a malformed one as a :class:`UsageError`."""
    try:
        return parse_rate(text, name=what)
    except ValueError as error:
        raise UsageError(str(error)) from None


def parse_count(text: str, flag: str) -> float:
    """A positive count such as ``70B``, ``7e9``, ``1.5e9`` or ``4M``: suffixes K, M, B and T, in any case.

    Args:
      text: what the user typed.
      flag: the option, for the message.

    Returns:
      The count.
    """
    match = _COUNT_RE.match(text)
    if not match:
        raise UsageError(f"{flag} {text!r} is not a count: write e.g. 7e9, 7B, 70B or 1.5M (suffixes K, M, B, T)")
    count = float(match.group(1)) * _COUNT_SUFFIXES[match.group(2).lower()]
    if count <= 0:
        raise UsageError(f"{flag} {text!r} must be positive")
    return count
