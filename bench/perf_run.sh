#!/usr/bin/env bash
# One GPU run of the performance bench, sized for a 10-minute device command:
#   install   pip install -e . (the cutlass backend; FlashInfer off unless FI=1), tokamax from carried
#             wheels in .whl/ (git-ignored; see below) into /tmp/site
#   stages    bench/stage_breakdown.py: per-stage device time from a profiler trace, with kernel lists
#             (and, with STAGE_LOOP=N, each forward's device time per layer inside a traced loop of N layers)
#   bench     bench/moe_bench.py: xla, cutlass and tokamax on the four models at T=1 64 1024 4096
#             16384, with the in-loop device time per layer at T=1 and 16
#   fp8       (if time is left) bench/moe_bench.py --scheme fp8 on cutlass at T=4096 16384
# Each step runs under its own timeout and writes to ${OUT:-/tmp/jax_moe_perf} as it goes, so a step
# cut short still leaves the rows it printed. Set JAX_MOE_COMMIT (the device's copy of the tree may
# carry no git HEAD). Carry .fi (CUTLASS headers: the nvidia-cutlass wheel) and .whl; fill .whl with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     tokamax==0.0.17 einshape pydantic pydantic-core annotated-types typing-inspection qwix immutabledict tensorboardx
# Environment: MODELS, TOKENS, LOOP_TOKENS, STAGE_MODELS, STAGE_TOKENS, STAGE_LOOP, BENCH_TIMEOUT, STAGES_TIMEOUT,
# DEADLINE (seconds after which optional steps are skipped), SKIP_INSTALL=1, FI=1.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/jax_moe_perf}"; mkdir -p "$out"
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
filter() { grep --line-buffered -v "^[WIE][0-9]\{4\}\|^WARNING: All log messages"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit \
  --format=csv,noheader | tee "$out/gpu.txt"

if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  . bench/gpu_env.sh
  if [ "${FI:-0}" != 1 ]; then export JAX_MOE_WITH_FLASHINFER=OFF; unset JAX_MOE_FI_PREBUILT; fi
  python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/jax_moe_install.log 2>&1 \
    || { grep -E "error|FAILED" /tmp/jax_moe_install.log | head -20; tail -5 /tmp/jax_moe_install.log; exit 1; }
  echo "== install: $(elapsed) s" | tee -a "$out/gpu.txt"
  if ls .whl/tokamax-*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    # tokamax imports a profiler CLI it does not need for ragged_dot
    mkdir -p /tmp/site/xprof/cli && touch /tmp/site/xprof/__init__.py /tmp/site/xprof/cli/__init__.py
    printf 'def get_kernel_stats_tool(*a, **k):\n    raise NotImplementedError\n' > /tmp/site/xprof/cli/tools.py
  fi
fi
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
python3 -m jax_moe.info 2>&1 | filter | grep -E "native|cutlass|fused_experts" | head -12 | tee -a "$out/gpu.txt"
python3 -c "import tokamax; print('tokamax', tokamax.__version__)" 2>&1 | tail -1 | tee -a "$out/gpu.txt"

models="${MODELS:-qwen3 gptoss deepseek mixtral}"
timeout "${STAGES_TIMEOUT:-140}" python3 bench/stage_breakdown.py --models ${STAGE_MODELS:-qwen3 deepseek gptoss mixtral} \
  --tokens ${STAGE_TOKENS:-1 64 16384} --loop "${STAGE_LOOP:-0}" --kernels "$out/kernels.txt" --json "$out/stages.json" 2>&1 | filter \
  | tee "$out/stages.log"
echo "== stages: $(elapsed) s" | tee -a "$out/gpu.txt"

timeout "${BENCH_TIMEOUT:-300}" python3 bench/moe_bench.py --models $models \
  --tokens ${TOKENS:-1 64 1024 4096 16384} --impls xla cutlass tokamax --in-loop ${LOOP_TOKENS:-1 16} \
  --json "$out/bench.json" 2>&1 | filter | tee "$out/bench.log"
echo "== bench: $(elapsed) s" | tee -a "$out/gpu.txt"

left=$(( ${DEADLINE:-540} - $(elapsed) ))
if [ "$left" -gt 45 ]; then
  timeout "$left" python3 bench/moe_bench.py --scheme fp8 --models $models --tokens 4096 16384 --impls cutlass \
    --json /tmp/jax_moe_fp8.json 2>&1 | filter | tee "$out/fp8.log"
  echo "== fp8: $(elapsed) s" | tee -a "$out/gpu.txt"
else
  echo "== fp8: skipped ($left s left)" | tee -a "$out/gpu.txt"
fi
grep -h "^|" "$out/bench.log" | tail -3
