"""The state is never gathered: peak RSS during an update stays far below the state size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax_mlp

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, optax
    import jax_mlp
    sys.path.insert(0, sys.argv[2])
    from rss import update_rises

    n = 128 * 1024**2  # 128M float32 params: 512 MiB; adam state: 1 GiB
    params = {"w": jnp.ones((n // 1024, 1024), jnp.float32), "b": jnp.zeros((1024,), jnp.float32)}
    tx = jax_mlp.mlp_offload(optax.adam(1e-3), paths=[sys.argv[1]], host_cache="32MiB", subgroup_size="8MiB")
    rises = update_rises(tx, params)
    print(json.dumps({"rises": rises, "state_bytes": tx.plan.state_nbytes,
                      "subgroups": len(tx.plan.subgroups)}))
    tx.close(delete=True)
    """
)


def test_peak_rss_of_an_update_stays_below_params_plus_256MiB(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "tier"), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    params_bytes = 128 * 1024**2 * 4
    assert figures["state_bytes"] >= 2 * params_bytes
    assert figures["subgroups"] >= 100
    for rise in figures["rises"][1:]:  # the second and third updates
        assert rise < params_bytes + 256 * 1024**2, figures


def _device_memory(*arguments: str) -> dict:
    """``benchmarks/device_memory.py``'s figures for 8 MiB of bf16 params in 1 MiB subgroups (1/8 of its default
    size, the same ratios): peak live jax arrays during each step minus those live before (on CPU, the device's
    memory)."""
    script = Path(__file__).parents[1] / "benchmarks" / "device_memory.py"
    arguments = ("--params", "8MiB", "--subgroup-size", "1MiB", "--steps", "3", *arguments)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(script.parents[1]), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, str(script), *arguments], capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_device_memory_of_the_fused_apply_stays_below_half_the_params_with_one_write_in_flight():
    """The optax route holds fp32 updates (2x the bf16 params), then new params beside the old; the fused apply
    with ``write_depth=1`` holds the fields of the subgroup computing, its results and the write in flight."""
    rises = _device_memory("--write-depth", "1")["rise_over_params"]
    assert min(rises["optax"]) >= 2, rises
    assert max(rises["apply"]) <= 0.5, rises


def test_device_memory_of_the_fused_apply_is_bounded_by_its_records_in_flight_not_the_params():
    """With the default options the fused apply's rise is three subgroups' records (the one computing, its
    results, the one before it being staged to the host), and one more a moment longer now and then on the CPU
    backend, whatever ``write_depth``: its four writes in flight hold host copies only (were they to hold their
    device arrays, the rise would be ``write_depth + 2`` records, twice the bound). A constant of the options,
    whatever the params' size."""
    figures = _device_memory()
    assert figures["write_depth"] == jax_mlp.OffloadConfig.defaults()["write_depth"] == 4
    in_records = figures["apply_rise_over_records_in_flight"]
    assert max(in_records) <= 4 / 3, figures
