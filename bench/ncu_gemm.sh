#!/usr/bin/env bash
# One grouped GEMM of a prepared forward under Nsight Compute, on the device, with its stalls summed:
#   bench/ncu_gemm.sh MODEL SCHEME T KERNEL [NAME]
#   bench/ncu_gemm.sh qwen3 fp8 4096 ScatterRowsAdapter gemm2_fp8
# KERNEL is a regular expression on the demangled kernel name: ScatterRowsAdapter (GEMM2 with the
# weighted scatter-add epilogue, the default finalize), GatedActEpilogue (GEMM1 with the activation
# epilogue), CollectiveEpilogue (GEMM2 of the gathering forward: run with JAX_MOE_CUTLASS_FINALIZE=gather),
# GroupProblemShape (every grouped GEMM). The tree must be installed (pip install -e .). ROUTING=balanced
# gives every expert the same rows (bench/profile_forward.py --routing). NCU_METRICS=name,name collects
# more metrics; they print on the details page, and those of the tensor pipe and the L2 in the summary.
# On an H200: sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active (the tensor pipe's busy
# share), sm__inst_executed_pipe_tensor_op_gmma.sum (WGMMA instructions), lts__t_sectors_op_read.sum.
# The third forward's kernel is profiled (bench/profile_forward.py; the first compiles) with the
# sections below; if ncu fails with SourceCounters, it is run again without it (no stall samples).
# Writes to ${OUT:-/tmp/ncu_gemm}: NAME.ncu-rep, NAME.log (ncu's own output), NAME_details.txt (the
# sections), NAME_stalls.txt (bench/ncu_stalls.py on the SASS source page), NAME_bytes.md (for
# GatedActEpilogue and ScatterRowsAdapter: bench/ncu_bytes.py, DRAM bytes, from the DRAM's counters,
# against the least the GEMM must move). Every step writes to files, not pipes, so that a timed-out
# profile (NCU_TIMEOUT seconds, default 150) cannot hang it.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 4 ] || { echo "usage: bench/ncu_gemm.sh MODEL SCHEME T KERNEL [NAME]" >&2; exit 2; }
model=$1 scheme=$2 tokens=$3 kernel=$4 name=${5:-${1}_${2}_${3}}
out="${OUT:-/tmp/ncu_gemm}"; mkdir -p "$out"
command -v ncu > /dev/null || { echo "ncu_gemm.sh: ncu is not on PATH" >&2; exit 2; }
sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats
          --section WarpStateStats --section Occupancy --section LaunchStats
          --metrics "dram__bytes_read.sum,dram__bytes_write.sum${NCU_METRICS:+,$NCU_METRICS}")
# (the DRAM's bytes, counted, for ncu_bytes.py; NCU_METRICS=a,b adds metrics to the details page)
# XLA takes most of the GPU's memory up front by default; ncu's kernel replay needs room of its own to
# save and restore what the kernel writes, and without it fails to profile ("error code (9)").
profile() {  # profile EXTRA_SECTION_ARGS...
  env -u XLA_PYTHON_CLIENT_MEM_FRACTION XLA_PYTHON_CLIENT_PREALLOCATE=false \
    timeout --kill-after=10 "${NCU_TIMEOUT:-150}" ncu --clock-control none --kernel-name-base demangled \
      -k "regex:$kernel" --launch-skip 2 --launch-count 1 "${sections[@]}" "$@" -f -o "$out/$name" \
      python3 bench/profile_forward.py --model "$model" --scheme "$scheme" --tokens "$tokens" --runs 4 \
        --routing "${ROUTING:-random}" \
      > "$out/$name.log" 2>&1 && [ -f "$out/$name.ncu-rep" ]
}
if ! profile --section SourceCounters; then
  echo "ncu_gemm.sh: $name: ncu failed with SourceCounters (see $name.log); again without it" >&2
  mv "$out/$name.log" "$out/${name}_sourcecounters.log"
  profile || { echo "ncu_gemm.sh: $name: ncu failed (see $name.log)" >&2; tail -5 "$out/$name.log" >&2; exit 1; }
fi
ncu -i "$out/$name.ncu-rep" --print-summary none > "$out/${name}_details.txt" 2>&1
ncu -i "$out/$name.ncu-rep" --page source --print-source sass --csv > "$out/${name}_source.csv" 2> /dev/null
python3 bench/ncu_stalls.py "$out/${name}_source.csv" > "$out/${name}_stalls.txt" 2>&1 \
  || echo "ncu_gemm.sh: $name: no stall samples in the report" >&2
rm -f "$out/${name}_source.csv"
case "$kernel" in  # the GEMM's DRAM bytes against the least it must move (bench/ncu_bytes.py)
  *ScatterRows*) gemm=gemm2 ;;
  *GatedAct*) gemm=gemm1 ;;
  *CollectiveEpilogue*) gemm=gemm2_gather ;;
  *) gemm= ;;
esac
[ -n "$gemm" ] && python3 bench/ncu_bytes.py "$out/${name}_details.txt" --model "$model" --scheme "$scheme" \
  --tokens "$tokens" --gemm "$gemm" > "$out/${name}_bytes.md" 2>&1
grep -E "^  [a-z_]+ *device_kernel|Duration|DRAM Throughput|Memory Throughput +[TG]byte/s|L2 Cache Throughput|Compute \(SM\) Throughput|SM Frequency|Issued Warp|No Eligible|Spilling Requests |dram__bytes_|pipe_tensor|lts__t_sectors" \
  "$out/${name}_details.txt" | head -20
[ -n "$gemm" ] && cat "$out/${name}_bytes.md"
head -30 "$out/${name}_stalls.txt"
