#!/usr/bin/env bash
# Compile check of FlashInfer's TRT-LLM gen MoE module (cmake/flashinfer_trtllm.cmake) for sm_100a,
# no GPU needed: configure, build libjax_moe_trtllm.so and _jax_moe_trtllm, print each translation
# unit's compile time (from .ninja_log) and the undefined symbols the two libraries leave to the
# process (CUDA driver API and libc/libstdc++ are expected; anything else is a bug).
#
#   bench/check_trtllm_build.sh PACK [FLASHINFER_DIR] [BUILD_DIR]
#
# PACK: a TRT-LLM gen batched-GEMM pack (<hash>/batched_gemm-.../ with include/flashinferMetaInfo.h
# and include/trtllmGen_bmm_export/), see the README. Python: $PYTHON (default python3) with jax,
# nanobind and apache-tvm-ffi. cuBLAS/cuRAND headers: $CUBLAS_INCLUDE_DIR/$CURAND_INCLUDE_DIR, the
# toolkit or pip's nvidia-* wheels. Cores: $JOBS (default 2).
set -euo pipefail
pack=${1:?usage: $0 PACK [FLASHINFER_DIR] [BUILD_DIR]}
fi_dir=${2:-}
build=${3:-/tmp/trtllm_build}
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}

args=(-S "$root" -B "$build" -G Ninja -DPython_EXECUTABLE="$(command -v "$py")"
      -DJAX_MOE_CUDA_ARCHS=100a -DJAX_MOE_TRTLLM_BMM_DIR="$pack"
      -DJAX_MOE_WITH_FLASHINFER=OFF -DJAX_MOE_WITH_CUTLASS=OFF -DCMAKE_BUILD_TYPE=Release)
[[ -n "$fi_dir" ]] && args+=(-DFLASHINFER_SRC_DIR="$fi_dir")
status=$(cmake "${args[@]}" | grep "jax_moe:")
echo "$status"
grep -q "_jax_moe_trtllm: building for" <<<"$status" \
  || { echo "the TRT-LLM gen module is skipped (status line above)"; exit 1; }

start=$(date +%s)
ninja -C "$build" -j "${JOBS:-2}" jax_moe_trtllm _jax_moe_trtllm
echo "wall: $(( $(date +%s) - start )) s for the library and the module"

echo "--- compile time per translation unit (s, from .ninja_log)"
awk 'NR > 1 && ($4 ~ /jax_moe_trtllm/) { t[$4] = ($2 - $1) / 1000 }  # the latest build of each
     END { for (o in t) printf "%7.1f  %s\n", t[o], o }' "$build/.ninja_log" | sort -rn

echo "--- undefined dynamic symbols other than the CUDA driver API, Python's C API, libc/libstdc++/libgcc"
echo "    and (for the module) what libjax_moe_trtllm.so defines: an empty list is the expected result"
lib="$build/libjax_moe_trtllm.so"
nm -D --defined-only "$lib" | awk '{ print $3 }' | sort -u > "$build/trtllm_defined.txt"
for so in "$lib" "$build"/_jax_moe_trtllm*.so; do
  echo "$(basename "$so"):"
  nm -D -u "$so" | awk '$1 == "U" { print $2 }' | grep -vE '@(GLIBC|GLIBCXX|CXXABI|GCC)_|^(cu[A-Z]|_?Py)' \
    | sort -u | comm -23 - "$build/trtllm_defined.txt" | sed 's/^/  /' || true
done
