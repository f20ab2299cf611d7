#!/usr/bin/env bash
# GPU checks of jax_mlp in one command, writing gpu.json, host_params.json, overlap_step.json and
# layers_step.json to $OUT (default: ./results). The timeouts add up past one device call's 600 s:
# give each script a call of its own there (`python benchmarks/gpu/NAME.py --out "$OUT"`).
#
#   bash benchmarks/gpu/run.sh            # on a GPU machine: bench.py took about 3 minutes on an H200;
#                                         # host_params_step.py, overlap_step.py and layers_step.py
#                                         # have not run on a GPU yet
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
timeout 240 "${PYTHON:-python3}" benchmarks/gpu/overlap_step.py --out "$out" "$@"
exec timeout 240 "${PYTHON:-python3}" benchmarks/gpu/layers_step.py --out "$out" "$@"
