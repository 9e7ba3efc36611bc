#!/usr/bin/env bash
# GPU run with the FlashInfer CUTLASS MoE built in. Needs either .fi/fi_src.tar.xz
# (bench/pack_flashinfer_src.sh; carried to the machine) for a source build, or JAX_MOE_FI_PREBUILT
# pointing at a libjax_moe_fi.so built before (or JAX_MOE_FI_PREBUILT_XZ at an xz-packed one, as
# the pack step writes it). Steps (STEPS, default "build test bench"):
#   build  pip install -e . with the FlashInfer module (timed; ninja -j$(nproc)), for the schemes in
#          JAX_MOE_FI_SCHEMES (default "bf16;fp8;mxfp4"; opt-in: ";fp8_block" DeepSeek-V3 FP8 block
#          scales, ";f16" FP16, ";w4a8" int4 x FP8 W4A8). A build cut off by a command's time limit
#          resumes where it stopped when the same command runs again on the still-warm machine
#          (the build directory is kept).
#   pack   xz the built libjax_moe_fi.so into $OUT (carry it back in as JAX_MOE_FI_PREBUILT_XZ to
#          skip the kernel build on a fresh machine, e.g. a multi-GPU one)
#   relink the same install against the libjax_moe_fi.so just built, as a prebuilt library
#          (JAX_MOE_FI_PREBUILT; timed, separate build dir), then the FlashInfer tests
#   test   python -m jax_moe.info (bf16, fp8, mxfp4) and every GPU test (pytest -m gpu), or PYTEST_ARGS's
#          selection: the whole GPU suite now outlasts one 10-minute device command, so split it, e.g.
#          PYTEST_ARGS="tests/test_flashinfer_cutlass*.py tests/test_nn.py tests/test_gpu_xla.py" (~6 min)
#          then PYTEST_ARGS="tests/test_moe_kernels_gpu.py tests/test_cutlass_backend.py tests/test_cutlass_fp8.py
#          tests/test_cutlass_batched.py tests/test_ffi_sort.py".
#          PYTEST_ARGS is split on spaces; a -k expression goes in PYTEST_K (e.g. PYTEST_K="mxfp4 or fp8").
#          Set JAX_MOE_COMMIT: the device's copy of the tree may not carry this checkout's git HEAD.
#   bench  bench/moe_bench.py --write for each scheme in BENCH_SCHEMES (default "bf16 fp8"; mxfp4 too,
#          e.g. BENCH_SCHEMES=mxfp4 BENCH_ARGS="--models gptoss"; fp8_block, w4a8 and f16 with a build
#          of those opt-in schemes, e.g. BENCH_SCHEMES=fp8_block BENCH_ARGS="--models deepseek"),
#          with BENCH_ARGS, each under BENCH_TIMEOUT seconds
# Logs go to ${OUT:-/tmp/jax_moe_gpu}; a short summary is printed.
set -uo pipefail
out="${OUT:-/tmp/jax_moe_gpu}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
steps="${STEPS:-build test bench}"
filter() { grep --line-buffered -v "^[WIE][0-9]\{4\}"; }
if [ -n "${JAX_MOE_FI_PREBUILT_XZ:-}" ]; then
  xz -dc "$JAX_MOE_FI_PREBUILT_XZ" > /tmp/libjax_moe_fi.so && export JAX_MOE_FI_PREBUILT=/tmp/libjax_moe_fi.so
fi
if [[ " $steps " == *" build "* ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
  export JAX_MOE_WITH_FLASHINFER=ON CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)"
  if [ -f .fi/fi_src.tar.xz ]; then  # FlashInfer's sources: its MoE runner and the CUTLASS headers
    mkdir -p /tmp/fisrc && tar xJf .fi/fi_src.tar.xz -C /tmp/fisrc
    export FLASHINFER_SRC_DIR=/tmp/fisrc/flashinfer
  elif [ -z "${JAX_MOE_FI_PREBUILT:-}" ]; then
    echo "needs .fi/fi_src.tar.xz (bench/pack_flashinfer_src.sh) or JAX_MOE_FI_PREBUILT"; exit 1
  fi
  start=$(date +%s)
  python3 -m pip install --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1 \
    || { grep -E "error|FAILED" "$out/build.log" | head -30; tail -5 "$out/build.log"; exit 1; }
  echo "build (CPU + CUDA + FlashInfer modules, $(nproc) cores${JAX_MOE_FI_PREBUILT:+, prebuilt FlashInfer library}): $(( $(date +%s) - start )) s" | tee -a "$out/gpu.txt"
  grep -E "jax_moe: (FlashInfer|CUTLASS|building)" "$out/build.log" | sed 's/^ *//' | tee -a "$out/gpu.txt"
fi
if [[ " $steps " == *" pack "* ]]; then
  lib=$(find build -name libjax_moe_fi.so -not -path "*/prebuilt/*" | head -1)
  xz -T0 -6 -c "$lib" > "$out/libjax_moe_fi.so.xz" && ls -la "$out/libjax_moe_fi.so.xz" | tee -a "$out/gpu.txt"
fi
if [[ " $steps " == *" relink "* ]]; then
  lib=$(find build -name libjax_moe_fi.so -not -path "*/prebuilt/*" | head -1)
  cp "$lib" /tmp/libjax_moe_fi.so && ls -la /tmp/libjax_moe_fi.so | tee -a "$out/gpu.txt"
  start=$(date +%s)
  JAX_MOE_WITH_FLASHINFER=ON JAX_MOE_FI_PREBUILT=/tmp/libjax_moe_fi.so python3 -m pip install --no-build-isolation \
    --no-deps -e . --config-settings=build-dir=build/prebuilt > "$out/relink.log" 2>&1 \
    || { tail -30 "$out/relink.log"; exit 1; }
  echo "install against the prebuilt libjax_moe_fi.so: $(( $(date +%s) - start )) s" | tee -a "$out/gpu.txt"
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_flashinfer_cutlass*.py -k "matches or fp8_matches" 2>&1 \
    | filter | tail -2 | tee -a "$out/gpu.txt"
fi
if [[ " $steps " == *" test "* ]]; then
  for s in bf16 fp8 mxfp4 fp8_block w4a8; do python3 -m jax_moe.info --scheme "$s" 2>&1 | filter; done | tee "$out/info.txt"
  # -v: a line per test, so a run cut off by the time limit still leaves its log
  python3 -m pytest -v -m gpu -p no:cacheprovider ${PYTEST_ARGS:-} ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | filter \
    > "$out/pytest_gpu.log"
  grep -E " FAILED| ERROR|passed|failed" "$out/pytest_gpu.log" | tail -15
fi
if [[ " $steps " == *" bench "* ]]; then
  for s in ${BENCH_SCHEMES:-bf16 fp8}; do
    plot=bench/roofline.png; [ "$s" = bf16 ] || plot="bench/roofline_$s.png"
    JAX_MOE_PLOT="$plot" timeout "${BENCH_TIMEOUT:-240}" python3 bench/moe_bench.py --write --scheme "$s" ${BENCH_ARGS:-} 2>&1 | filter > "$out/bench_$s.log"
    grep "^|\|^#" "$out/bench_$s.log" | tail -30
  done
  cp bench/RESULTS.md bench/roofline*.png "$out/" 2>/dev/null
fi
