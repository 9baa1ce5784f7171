#!/usr/bin/env bash
# Benchmark runs for one device call, sourced by the call's script from the repository root:
#   source scripts/gpu-runs.sh SECONDS        every run below ends within SECONDS of this line
#   bench NAME TIMEOUT ARGS...                .gpu-bin/bin/spin_bench_model ARGS > $OUT/NAME.md;
#                                             echoes its exit, time and table rows
#   ncu_bench NAME TIMEOUT STEPS ARGS...      the same under ncu, profiling the benchmark's timed
#                                             steps only (STEPS = --decode-tokens x --repeats);
#                                             $OUT/NAME.csv, then bench/gpu/ncu_summary.py's table
#   wrap NAME BUILD ARGS...                   .gpu-bin/NAME/spin_bench_model: BUILD's, ARGS first
#                                             (one build, two settings, for an A/B)
#   ab NAME BEFORE AFTER TIMEOUT ARGS...      scripts/gpu-ab.sh, one round: .gpu-bin/BEFORE's then
#                                             .gpu-bin/AFTER's spin_bench_model with ARGS;
#                                             $OUT/ab_NAME.{txt,md}; echoes its table's last rows
#   gpu_tests BUILD TIMEOUT [FILTER]          .gpu-bin/BUILD/spin_gpu_tests (gtest FILTER, default
#                                             all) > $OUT/gpu_tests.txt; echoes failures, summary
#   products TIMEOUT BUILD...                 each BUILD's spin_bench_gpu_kernels products >
#                                             $OUT/products_BUILD.csv, then bench/gpu/
#                                             products_compare.py's table of them
# A run gets TIMEOUT seconds or what the call has left, and is skipped with under 30 s left.
# Builds carried gzipped in .gpu-bin/gz/BUILD/ (several fit in what a call carries) are unpacked
# into .gpu-bin/BUILD/ first. A call returns at most 8 files from $OUT: when the script ends with
# more there, they are bundled into $OUT/out.tar.gz.
export CUDA_MODULE_LOADING=EAGER
for gz in .gpu-bin/gz/*/*.gz; do
  [ -e "$gz" ] || continue
  build=.gpu-bin/$(basename "$(dirname "$gz")")
  mkdir -p "$build"
  gunzip -c "$gz" >"$build/$(basename "$gz" .gz)"
done
unset gz build
chmod +x .gpu-bin/*/* 2>/dev/null
source scripts/gpu-deps-env.sh
SPIN_CALL_END=$((SECONDS + ${1:-540}))

pack_out() {
  [ -n "${OUT:-}" ] && [ -d "$OUT" ] || return 0
  local n
  n=$(find "$OUT" -type f | wc -l)
  [ "$n" -gt 8 ] || return 0
  tar -czf /tmp/spin-out.tar.gz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/spin-out.tar.gz "$OUT/out.tar.gz"
  echo "== $n files in \$OUT, more than a call returns: bundled into out.tar.gz"
}
trap pack_out EXIT

# Seconds a run may take: its own limit, or what the call has left.
run_limit() {
  local t=$1 left=$((SPIN_CALL_END - SECONDS))
  echo $((t < left ? t : left))
}

# Sets the caller's t to what run NAME may take (run_limit LIMIT); false, after saying so, with
# under 30 s left in the call (a LIMIT under 30 s is the run's own and is kept).
time_for() {
  [ $((SPIN_CALL_END - SECONDS)) -ge 30 ] || { echo "== $1 skipped (time)"; return 1; }
  t=$(run_limit "$2")
}

bench() {
  local name=$1 t start=$SECONDS
  time_for "$name" "$2" || return 0
  shift 2
  timeout "$t" .gpu-bin/bin/spin_bench_model "$@" >"$OUT/$name.md" 2>&1
  echo "== $name exit $? in $((SECONDS - start)) s"
  grep -a '^| [0-9]\|rror\|^- batch' "$OUT/$name.md" | cut -c1-400
}

ncu_bench() {
  local name=$1 t steps=$3
  time_for "$name" "$2" || return 0
  shift 3
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

wrap() {
  local name=$1 build=$2
  shift 2
  mkdir -p ".gpu-bin/$name"
  printf '#!/usr/bin/env bash\nexec %s/.gpu-bin/%s/spin_bench_model %s "$@"\n' "$PWD" "$build" "$*" \
    >".gpu-bin/$name/spin_bench_model"
  chmod +x ".gpu-bin/$name/spin_bench_model"
}

ab() {
  local name=$1 before=$2 after=$3 t start=$SECONDS
  time_for "$name" "$4" || return 0
  shift 4
  SPIN_AB_TIMEOUT=$((t / 2)) bash scripts/gpu-ab.sh ".gpu-bin/$before/spin_bench_model" \
    ".gpu-bin/$after/spin_bench_model" 1 "$@" >"$OUT/ab_$name.txt" 2>&1
  mv "$OUT/ab.md" "$OUT/ab_$name.md"
  echo "== $name ($before -> $after) in $((SECONDS - start)) s"
  tail -n 7 "$OUT/ab_$name.txt" | cut -c1-250
}

gpu_tests() {
  local build=$1 t start=$SECONDS
  time_for "$build gpu tests" "$2" || return 0
  timeout "$t" ".gpu-bin/$build/spin_gpu_tests" --gtest_brief=1 --gtest_filter="${3:-*}" >"$OUT/gpu_tests.txt" 2>&1
  echo "== $build gpu tests exit $? in $((SECONDS - start)) s"
  grep -a "FAILED\|Failure\|expected" "$OUT/gpu_tests.txt" | head -12
  tail -n 3 "$OUT/gpu_tests.txt"
}

products() {
  local limit=$1 build t
  shift
  for build in "$@"; do
    time_for "products $build" "$limit" || continue
    timeout "$t" ".gpu-bin/$build/spin_bench_gpu_kernels" products "$OUT/products_$build.csv" >/dev/null 2>&1
    echo "== products $build exit $?"
  done
  python3 bench/gpu/products_compare.py "$OUT" "$@"
}
