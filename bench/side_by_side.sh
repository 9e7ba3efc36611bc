#!/usr/bin/env bash
# A change against a baseline on one GPU, in one device command: builds the working tree ("new")
# and .base/ ("base", written by `python bench/side_by_side.py prepare REV` and carried with .fi)
# side by side, then runs the bench command in each, alternating base and new, ROUNDS times, and
# prints the table of the two (bench/side_by_side.py).
#   bench/side_by_side.sh ROUNDS -- python3 bench/stage_breakdown.py --scheme fp8 --no-peer --models qwen3
#   bench/side_by_side.sh 2 -- env XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 bench/stage_breakdown.py \
#       --scheme bf16 fp8 --no-peer --models qwen3 --tokens 1 4096      # both schemes, command buffers off
#   bench/side_by_side.sh 1 -- python3 bench/moe_bench.py --models qwen3 --tokens 16 256 --impls cutlass \
#       --in-loop 16 256 --layers 8                                      # per call and per layer in a loop
# The command runs in each tree's copy with that tree's build on PYTHONPATH, and gets
# `--json <side>_<round>.json` appended (kept in /tmp/side_by_side/rounds, and packed to
# $OUT/rounds.tgz). $OUT also gets gpu.txt, runs.log (the runs' output), table.md and, where a build
# fails, its install log: few files, as the device tool brings back only so many. Both builds share
# the machine's cores (the two took 154-163 s on an H200's 16 cores, one alone ~105 s). FlashInfer
# is left out unless FI=1.
# Environment: OUT (default /tmp/side_by_side_out), STEP_TIMEOUT (seconds per bench run, default 120),
# REUSE=1 (a later command on the same warm machine: run the new bench command in the two builds the
# last command left, no copy and no build; the last command's rounds are dropped, packed already),
# WORK (the builds' folder, default /tmp/side_by_side).
set -uo pipefail
cd "$(dirname "$0")/.."
rounds="${1:?usage: bench/side_by_side.sh ROUNDS -- COMMAND...}"; shift
[ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || { echo "side_by_side.sh: no bench command given" >&2; exit 2; }
[ -d .base ] || { echo "side_by_side.sh: no .base/ (python bench/side_by_side.py prepare REV, then carry .base)" >&2; exit 2; }
# Both sides run the command in their own tree: a file it names must be in both, or the base's runs
# fail after the builds (minutes of device time) with nothing to compare.
for arg in "$@"; do
  case "$arg" in /*) continue ;; esac
  if [ -f "$arg" ] && [ ! -f ".base/$arg" ]; then
    echo "side_by_side.sh: $arg is not in .base/ (the base's tree): commit it and prepare the base again" >&2
    exit 2
  fi
done
out="${OUT:-/tmp/side_by_side_out}"; mkdir -p "$out"
work="${WORK:-/tmp/side_by_side}"
if [ "${REUSE:-0}" = 1 ]; then
  for side in base new; do
    [ -d "$work/$side/site/jax_moe" ] || {
      echo "side_by_side.sh: REUSE=1 but $work/$side holds no build (the machine went back?): run without REUSE" >&2
      exit 2; }
  done
  rm -rf "$work/rounds"; mkdir -p "$work/rounds"
else
  rm -rf "$work"; mkdir -p "$work/new" "$work/base" "$work/rounds"
fi
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
filter() { grep --line-buffered -v "^[WIE][0-9]\{4\}\|^WARNING: All log messages"; }

. bench/gpu_env.sh
if [ "${FI:-0}" != 1 ]; then export JAX_MOE_WITH_FLASHINFER=OFF; unset JAX_MOE_FI_PREBUILT; fi
export CMAKE_BUILD_PARALLEL_LEVEL=$(( $(nproc) / 2 + 1 ))
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv,noheader | tee "$out/gpu.txt"
echo "base: $(cat .base/BASE_COMMIT 2>/dev/null || echo '?'); new: ${JAX_MOE_COMMIT:-the working tree}" | tee -a "$out/gpu.txt"
if [ "${REUSE:-0}" = 1 ]; then
  echo "== reusing both builds in $work" | tee -a "$out/gpu.txt"
else
  tar --exclude=./build --exclude=./.base --exclude=./.fi --exclude=./.whl --exclude=./.git -cf - . | tar -xf - -C "$work/new"
  (cd .base && tar --exclude=./build -cf - .) | tar -xf - -C "$work/base"

  # A plain (not editable) install of each tree into its own folder, then its extension modules copied
  # next to its sources, so that the bench, which puts its tree first on sys.path, imports that build.
  build() {
    local side=$1 dir="$work/$1"
    ( cd "$dir" && python3 -m pip install -q --no-build-isolation --no-deps --target "$dir/site" \
        -C build-dir="$dir/build" . > "$work/install_$side.log" 2>&1 ) \
      && cp -r "$dir"/site/jax_moe/*.so "$dir/jax_moe/" \
      || { echo "== $side: install failed"; cp "$work/install_$side.log" "$out/"
           grep -E "error|FAILED" "$work/install_$side.log" | head -20; return 1; }
  }
  build base & pb=$!; build new & pn=$!
  wait $pb || exit 1; wait $pn || exit 1
  echo "== built both: $(elapsed) s" | tee -a "$out/gpu.txt"
fi

export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}" PYTHONUNBUFFERED=1
for round in $(seq 1 "$rounds"); do
  for side in base new; do
    ( cd "$work/$side" && PYTHONPATH="$work/$side/site${PYTHONPATH:+:$PYTHONPATH}" \
        timeout "${STEP_TIMEOUT:-120}" "$@" --json "$work/rounds/${side}_$round.json" ) 2>&1 | filter \
      | sed "s/^/[$side $round] /" >> "$out/runs.log"
    echo "== $side round $round: rc ${PIPESTATUS[0]}, $(elapsed) s" | tee -a "$out/gpu.txt"
  done
done
tar -czf "$out/rounds.tgz" -C "$work/rounds" .
python3 bench/side_by_side.py table "$work/rounds" | tee "$out/table.md"
