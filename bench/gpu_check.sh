#!/usr/bin/env bash
# One GPU run: build (timed), the GPU tests, the bench; logs under ${OUT:-/tmp/jax_moe_gpu}.
# Usage: bash bench/gpu_check.sh [pytest args...]; BENCH_ARGS="..." to change the bench, BENCH=0 to skip it.
set -uo pipefail
out="${OUT:-/tmp/jax_moe_gpu}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
start=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s" | tee -a "$out/gpu.txt"
python3 -m jax_moe.info 2>&1 | grep -v "^[WI]0000" | tee "$out/info.txt"
python3 -m pytest -q -m gpu -p no:cacheprovider "$@" 2>&1 | grep -v "^[WIE][0-9]\{4\}" | tee "$out/pytest_gpu.log" | tail -25
if [ "${BENCH:-1}" = "1" ]; then
  python3 bench/moe_bench.py --write ${BENCH_ARGS:-} 2>&1 | grep -v "^[WIE][0-9]\{4\}" > "$out/bench.log"
  cp bench/RESULTS.md bench/roofline.png "$out/" 2>/dev/null
  tail -30 "$out/bench.log"
fi
