#!/usr/bin/env bash
# GPU checks of jax_mlp in one command, writing gpu.json, host_params.json and overlap_step.json to $OUT
# (default: ./results).
#
#   bash benchmarks/gpu/run.sh            # on a GPU machine: bench.py took about 3 minutes on an H200;
#                                         # host_params_step.py and overlap_step.py have not run on a GPU yet
#   bash benchmarks/gpu/run.sh --dry-run  # anywhere: tiny sizes on the CPU, checks that it all runs
#
# Needs only jax, optax and tensorstore (as on the lent H200); jax_mlp is used from this checkout.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out="${OUT:-results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
timeout 470 "${PYTHON:-python3}" benchmarks/gpu/bench.py --out "$out" "$@"
timeout 300 "${PYTHON:-python3}" benchmarks/gpu/host_params_step.py --out "$out" "$@"
exec timeout 240 "${PYTHON:-python3}" benchmarks/gpu/overlap_step.py --out "$out" "$@"
