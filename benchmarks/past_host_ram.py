"""Training past host RAM, for real: ``examples/layered_gpt.py`` under a memory cgroup smaller than its model.

The run's memory is capped by a cgroup v1 memory controller (as root: a group under
``/sys/fs/cgroup/memory``, the cap in ``memory.limit_in_bytes``) at ``--fraction`` (default half) of
the model's params plus grads, the blocks made one at a time straight into the tiers
(``--layer-init``). It trains ``--steps`` steps and reports the group's peak
(``memory.max_usage_in_bytes``) against the model. The same config then runs without a cap, and the
two runs' final params must be the same bits (the cap changes what is where, never the math).
Last, a run capped at a quarter of what ``jax_mlp``'s own estimate says the run needs must fail up
front with the library's error, not the kernel's OOM killer.

    sudo python benchmarks/past_host_ram.py --layers 32 --d-model 2048 --steps 2 --host-cache 1536MiB --out results/

The model must be large enough that a quarter of what the run needs is still above what Python and
JAX take to start (about 0.7 GB here): below that, the kernel kills the interpreter before any of
jax_mlp runs.

Writes ``past_host_ram.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import uuid

ROOT = pathlib.Path(__file__).resolve().parents[1]
GROUPS = pathlib.Path("/sys/fs/cgroup/memory")


def model_bytes(layers: int, d_model: int, vocab: int = 96, seq_len: int = 64) -> int:
    """fp32 params of ``examples/layered_gpt.py``'s model: per block the attention, the MLP and two norms."""
    block = 3 * d_model * d_model + 3 * d_model + d_model * d_model + d_model + 8 * d_model * d_model + 5 * d_model
    block += 4 * d_model
    outer = vocab * d_model + seq_len * d_model + 2 * d_model + d_model * vocab + vocab
    return 4 * (layers * block + outer)


def run(args: argparse.Namespace, cap: int | None, tiers: pathlib.Path, out: pathlib.Path) -> dict:
    """The example in a fresh cgroup capped at ``cap`` bytes (None: no cap); its JSON, exit code and peak."""
    command = [
        sys.executable,
        str(ROOT / "examples" / "layered_gpt.py"),
        "--layers", str(args.layers), "--d-model", str(args.d_model), "--heads", "8",
        "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--layer-init",
        "--host-cache", args.host_cache, "--subgroup-size", args.subgroup_size, "--log-every", "1",
        "--paths", str(tiers / "nvme"), str(tiers / "pfs"), "--json", str(out), "--params-hash",
    ]  # fmt: skip
    group = None
    if cap is not None:
        group = GROUPS / f"jax_mlp_{uuid.uuid4().hex[:8]}"
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(cap))
        command = ["sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh", *command]
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS="--xla_force_host_platform_device_count=1")
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout)
        peak = int((group / "memory.max_usage_in_bytes").read_text()) if group is not None else None
    finally:
        if group is not None:
            group.rmdir()
    shutil.rmtree(tiers, ignore_errors=True)  # the next run's tiers need the room
    print(f"cap {cap}: exit {done.returncode}, peak {peak}; {done.stdout.strip().splitlines()[-1:]}", flush=True)
    result = json.loads(out.read_text()) if done.returncode == 0 else {}
    return {"rc": done.returncode, "peak_bytes": peak, "result": result, "stderr": done.stderr[-2000:], "cap": cap}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--host-cache", default="1536MiB")
    parser.add_argument("--subgroup-size", default="16MiB")
    parser.add_argument("--fraction", type=float, default=0.5, help="the cap, of the params plus grads")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", default="results")
    args = parser.parse_args(argv)
    params = model_bytes(args.layers, args.d_model)
    cap = int(args.fraction * 2 * params)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as scratch:
        scratch = pathlib.Path(scratch)
        capped = run(args, cap, scratch / "capped", scratch / "capped.json")
        free = run(args, None, scratch / "free", scratch / "free.json")
        tiny = run(args, cap // 4, scratch / "tiny", scratch / "tiny.json")
    same = bool(capped["result"]) and capped["result"]["params_hash"] == free["result"].get("params_hash")
    figures = {
        "params_bytes": params,
        "params_and_grads_bytes": 2 * params,
        "cap_bytes": cap,
        "capped": capped if capped["rc"] else {k: v for k, v in capped.items() if k != "stderr"},
        "peak_over_params_and_grads": None if capped["peak_bytes"] is None else capped["peak_bytes"] / (2 * params),
        "same_bits_without_the_cap": same,
        "quarter_cap": {"rc": tiny["rc"], "cap": tiny["cap"], "error": tiny["stderr"].strip().splitlines()[-1:]},
    }
    print(json.dumps(figures, indent=1))
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    (pathlib.Path(args.out) / "past_host_ram.json").write_text(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    main()
