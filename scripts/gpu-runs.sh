#!/usr/bin/env bash
# Benchmark runs for one device call, sourced by the call's script from the repository root:
#   source scripts/gpu-runs.sh SECONDS        every run below ends within SECONDS of this line
#   bench NAME TIMEOUT ARGS...                .gpu-bin/bin/spin_bench_model ARGS > $OUT/NAME.md;
#                                             echoes its exit, time and table rows
#   ncu_bench NAME TIMEOUT STEPS ARGS...      the same under ncu, profiling the benchmark's timed
#                                             steps only (STEPS = --decode-tokens x --repeats);
#                                             $OUT/NAME.csv, then bench/gpu/ncu_summary.py's table
# A run gets TIMEOUT seconds or what the call has left, and is skipped with under 30 s left.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/* 2>/dev/null
source scripts/gpu-deps-env.sh
SPIN_CALL_END=$((SECONDS + ${1:-540}))

# Seconds a run may take: its own limit, or what the call has left.
run_limit() {
  local t=$1 left=$((SPIN_CALL_END - SECONDS))
  echo $((t < left ? t : left))
}

bench() {
  local name=$1 t
  t=$(run_limit "$2")
  shift 2
  if [ "$t" -lt 30 ]; then echo "== $name skipped (time)"; return 0; fi
  local start=$SECONDS
  timeout "$t" .gpu-bin/bin/spin_bench_model "$@" >"$OUT/$name.md" 2>&1
  echo "== $name exit $? in $((SECONDS - start)) s"
  grep -a '^| [0-9]\|rror\|^- batch' "$OUT/$name.md" | cut -c1-400
}

ncu_bench() {
  local name=$1 t steps=$3
  t=$(run_limit "$2")
  shift 3
  if [ "$t" -lt 30 ]; then echo "== $name skipped (time)"; return 0; fi
  local ncu
  ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  if [ -z "$ncu" ]; then echo "== $name: no ncu on this machine"; return 1; fi
  local start=$SECONDS
  timeout "$t" "$ncu" --clock-control none --metrics gpu__time_duration.sum --nvtx --nvtx-include "timed decode/" \
    --launch-count 4000 --print-summary per-kernel --csv .gpu-bin/bin/spin_bench_model "$@" \
    >"$OUT/$name.csv" 2>"$OUT/$name.err"
  echo "== $name exit $? in $((SECONDS - start)) s"
  python3 bench/gpu/ncu_summary.py --steps "$steps" "$OUT/$name.csv"
}
