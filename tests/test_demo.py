"""The README's demo trains: the loss falls and the offload stats come back (on a tiny config)."""

from __future__ import annotations

import importlib.util
import pathlib

DEMO = pathlib.Path(__file__).parents[1] / "examples" / "train_nnx.py"


def test_demo_loss_falls_with_offloaded_state(tmp_path):
    spec = importlib.util.spec_from_file_location("train_nnx", DEMO)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    result = demo.main(
        [
            "--steps",
            "60",
            "--hidden",
            "128",
            "--paths",
            str(tmp_path / "a"),
            str(tmp_path / "b"),
            "--host-cache",
            "64KiB",
            "--subgroup-size",
            "32KiB",
            "--log-every",
            "30",
        ]
    )
    assert result["final_loss"] < 0.7 * result["initial_loss"]
    stats = result["stats"]
    assert stats["step"] == 60
    assert stats["cache_misses"] > 0
    assert all(stats[f"bytes_read[{tmp_path / name}]"] > 0 for name in ("a", "b"))
