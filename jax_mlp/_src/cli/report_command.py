"""``jax-mlp report``: a ``log_to`` file drawn into one image (the plots need matplotlib, imported on use)."""

from __future__ import annotations

import argparse

from jax_mlp._src.cli.command import Command, UsageError, argument


def handle(args: argparse.Namespace) -> int:
    """``jax-mlp report``: plots a ``log_to`` file to an image."""
    try:
        from jax_mlp._src.cli import plots
    except ImportError as error:
        raise UsageError(
            f'the report needs matplotlib ({error}); install it with: pip install "jax_mlp[report]"'
        ) from None
    try:
        figure = plots.write_report(args.log, args.output, step=args.step)
    except plots.LogError as error:
        raise UsageError(str(error)) from None
    print(f"wrote {args.output}: " + "; ".join(ax.get_title() for ax in figure.axes))
    return 0


COMMAND = Command(
    name="report",
    handle=handle,
    summary="plot a telemetry log of mlp_offload (reads, compute and writes per path; throughput; placement)",
    description=(
        "Draws a telemetry log into one image with five panels:\n"
        "  1. the timeline of one update: when each path was reading or writing, and when each subgroup's\n"
        "     update was dispatched; I/O done between updates, while the model computed, is on the left;\n"
        "  2. time per update: waiting on reads, computing, waiting on writes;\n"
        "  3. throughput per path (MB/s while busy), against the probed bandwidth when the log has one,\n"
        "     else against the best observed;\n"
        "  4. placement: how many subgroups each path holds, step by step;\n"
        "  5. the host cache: subgroups served from RAM (hits) and read from a path (misses).\n\n"
        "Make the log by passing log_to to mlp_offload:\n"
        "  tx = jax_mlp.mlp_offload(optax.adamw(1e-3), paths=[...], log_to='run.jsonl')\n"
        "or run: python examples/train_gpt.py --log-to run.jsonl\n\n"
        "example:\n"
        "  jax-mlp report run.jsonl -o report.png\n"
        "  jax-mlp report run.jsonl -o step10.pdf --step 10"
    ),
    arguments=(
        argument("log", metavar="LOG", help="the JSON-lines file written by mlp_offload(..., log_to=LOG)"),
        argument(
            "-o",
            "--output",
            default="report.png",
            metavar="IMAGE",
            help="the image to write; .png, .pdf or .svg (default: %(default)s)",
        ),
        argument(
            "--step",
            type=int,
            default=None,
            help="the step whose update the timeline shows (default: the last one in the log)",
        ),
    ),
)
