#!/usr/bin/env bash
# GPU run with the FlashInfer CUTLASS MoE built in: needs .fi/fi_src.tar.xz (bench/pack_flashinfer_src.sh),
# carried to the machine. Builds (timed), runs the GPU tests, then the bench (BENCH_ARGS, BENCH_TIMEOUT).
set -uo pipefail
out="${OUT:-/tmp/jax_moe_gpu}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
mkdir -p /tmp/fisrc && tar xJf .fi/fi_src.tar.xz -C /tmp/fisrc
export FLASHINFER_SRC_DIR=/tmp/fisrc/flashinfer JAX_MOE_WITH_FLASHINFER=ON
start=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1 || { grep -E "error|FAILED" "$out/build.log" | head -30; exit 1; }
echo "build (CPU + CUDA + FlashInfer modules): $(( $(date +%s) - start )) s" | tee "$out/gpu.txt"
python3 -m jax_moe.info 2>&1 | grep -v "^[WIE][0-9]\{4\}" | tee -a "$out/gpu.txt"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_flashinfer_cutlass.py tests/test_ffi_sort.py 2>&1 \
  | grep -v "^[WIE][0-9]\{4\}" > "$out/pytest_gpu.log"; tail -6 "$out/pytest_gpu.log"
timeout "${BENCH_TIMEOUT:-240}" python3 bench/moe_bench.py --write ${BENCH_ARGS:-} 2>&1 | grep -v "^[WIE][0-9]\{4\}" > "$out/bench.log"
cp bench/RESULTS.md bench/roofline.png "$out/" 2>/dev/null; grep "^|\|^#" "$out/bench.log" | tail -30
