"""The ``jax-mlp`` command: its sub-commands, the parser built from them, and ``main``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from jax_mlp._src.cli import plan_command, probe_command, report_command
from jax_mlp._src.cli.command import PROG, Command, UsageError

COMMANDS: tuple[Command, ...] = (probe_command.COMMAND, plan_command.COMMAND, report_command.COMMAND)
"""The sub-commands, in the order ``jax-mlp --help`` lists them."""


def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
    """The ``jax-mlp`` argument parser, with one sub-parser per command.

    Args:
      commands: the sub-commands.

    Returns:
      The parser; parsed arguments carry their :class:`Command` as ``command``.
    """
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Tools for jax_mlp, which keeps an optax optimizer's state in host RAM and on storage paths "
            "instead of on the accelerator. Run 'jax-mlp COMMAND --help' for a command's details."
        ),
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for command in commands:
        sub = subparsers.add_parser(
            command.name,
            help=command.summary,
            description=command.description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        for arg in command.arguments:
            sub.add_argument(*arg.flags, **arg.options)
        sub.set_defaults(command=command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``jax-mlp``.

    Args:
      argv: the arguments after the program name; None reads ``sys.argv``.

    Returns:
      The exit status: 0 on success, 2 for a user mistake (reported as one line on stderr).
    """
    args = build_parser().parse_args(argv)
    try:
        return args.command.handle(args)
    except UsageError as error:
        print(f"{PROG} {args.command.name}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
