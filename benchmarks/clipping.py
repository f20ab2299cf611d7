"""When a clipped layer-streamed step's update runs: ``clipping="speculate"`` against ``"defer"``, on a kernel-throttled device.

The global norm of the grads is known only once the backward ends. Speculating, the update runs during
the backward on the unclipped grads and, when the clipping fires, is undone and run again after a
second backward; deferring, each layer's grads go to the tiers and its update runs just before the
next forward computes with it, which costs the grads' write and read every step, fired or not. Both
give the same bits. Measured side by side in each run, on a fresh throttled device (``devices.py``),
with the default options, on the model shapes of ``layers.py``:

- ``speculate``: the clipping never fires (``max_grad_norm`` far above the norm);
- ``speculate, fired``: it fires every step (``max_grad_norm`` far below), so every step is redone;
- ``defer``: the clipping never fires (whether it fires changes nothing in this order).

From these, the fraction of fired steps above which deferring wins:
``(defer - speculate) / (speculate fired - speculate)``. Needs root; writes ``clipping.json``.

    sudo python benchmarks/clipping.py --rate 200MB/s --runs 3 --out results/
"""

from __future__ import annotations

import os
import shutil
import statistics

import devices
import layers

MODES = {
    "speculate": dict(max_grad_norm=1e9),
    "speculate, fired": dict(max_grad_norm=1e-6),
    "defer": dict(max_grad_norm=1e9, clipping="defer"),
}


def main(argv: list[str] | None = None) -> dict:
    args, rate = layers.parse(__doc__, argv)
    rows = []
    for name, shape in layers.SHAPES.items():
        for run in range(args.runs):
            row = {"shape": name, "layers": shape[0], "width": shape[1], "run": run}
            with devices.throttled_devices([devices.Throttle(rate, rate)], size=2 << 30) as made:
                devices.join(made)
                for mode, options in MODES.items():
                    directory = os.path.join(made.devices[0].mount, mode.replace(", ", "_"))
                    seconds, stats, _ = layers.timed_steps([directory], args.steps, shape=shape, **options)
                    shutil.rmtree(directory)  # room on the device for the next mode's two slots
                    moved = stats[len(stats) // 2]
                    row[mode] = {
                        "step_s": statistics.median(seconds),
                        "bytes_read": sum(moved.bytes_read.values()),
                        "bytes_written": sum(moved.bytes_written.values()),
                    }
            step = {mode: row[mode]["step_s"] for mode in MODES}
            redo = step["speculate, fired"] - step["speculate"]
            row["defer_over_speculate"] = step["defer"] / step["speculate"]
            row["fired_fraction_where_defer_wins"] = (step["defer"] - step["speculate"]) / redo if redo > 0 else None
            rows.append(row)
            wins = row["fired_fraction_where_defer_wins"]
            print(
                f"{name:12} run {run}: speculate {step['speculate']:.2f} s, fired {step['speculate, fired']:.2f} s, "
                f"defer {step['defer']:.2f} s ({row['defer_over_speculate']:.2f}x); defer wins above "
                f"{'-' if wins is None else f'{wins:.0%}'} of the steps fired"
            )
    return layers.save({"rate": rate, "tokens_per_step": layers.TOKENS, "rows": rows}, args.out, "clipping.json")


if __name__ == "__main__":
    main()
