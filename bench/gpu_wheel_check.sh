#!/usr/bin/env bash
# Build the binary wheel once and install it into a fresh environment, as a GPU CI pipeline would
# (build job -> artifact -> test jobs), timing each step; logs and the wheel go to ${OUT:-/tmp/jax_moe_wheel}.
#   bash bench/gpu_wheel_check.sh            # the default build: cutlass from nvidia-cutlass's headers
#   . bench/gpu_env.sh; bash bench/gpu_wheel_check.sh   # with FlashInfer (prebuilt libjax_moe_fi.so)
# Offline machines: the build tools must be installed (pip wheel --no-build-isolation).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/jax_moe_wheel}"; mkdir -p "$out/dist"
py="${PYTHON:-python3}"
filter() { grep --line-buffered -v "^[WIE][0-9]\{4\}"; }
wheel="${WHEEL:-}"   # WHEEL=path: test a wheel built before instead of building one
if [ -z "$wheel" ]; then
  t0=$(date +%s)
  "$py" -m pip wheel -v --no-build-isolation --no-deps -w "$out/dist" . > "$out/wheel.log" 2>&1 \
    || { tail -30 "$out/wheel.log"; exit 1; }
  echo "== wheel build: $(( $(date +%s) - t0 )) s"
  grep -o "jax_moe: .*" "$out/wheel.log" | sort -u
  wheel=$(ls "$out"/dist/jax_moe-*.whl)
fi
ls -la "$wheel"
site=$(mktemp -d)/site   # a fresh install location; the machine's jax, numpy, flax stay visible
t0=$(date +%s)
"$py" -m pip install -q --no-deps --target "$site" "$wheel" || exit 1
echo "== wheel install into a fresh location: $(( $(date +%s) - t0 )) s"
work=$(mktemp -d); cp -r bench "$work/"; cd "$work"   # outside the checkout: the wheel's jax_moe is imported
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
"$py" -c "import jax_moe; print('jax_moe from', jax_moe.__file__)"
"$py" -m jax_moe.info 2>&1 | filter | tail -6
t0=$(date +%s)
timeout 300 "$py" bench/moe_bench.py --models qwen3 --tokens 1 1024 2>&1 | filter | grep "^|\|^#" | tail -6
echo "== bench/moe_bench.py --models qwen3 --tokens 1 1024 from the wheel: $(( $(date +%s) - t0 )) s"
IFS=';' read -ra extras <<< "${WHEEL_EXTRA:-}"   # ';'-separated scripts with their arguments
for extra in "${extras[@]}"; do timeout 300 "$py" $extra 2>&1 | filter | tail -24; done
