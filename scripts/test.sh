#!/usr/bin/env bash
# Sets up and runs the whole test suite: release build (CUDA compiled when nvcc exists) with all
# tests, the same suite under ASan+UBSan, and a bounded run of every libFuzzer target.
# Env: SPIN_FUZZ_SECONDS (default 60 per target), SPIN_SKIP_ASAN=1, SPIN_SKIP_FUZZ=1.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

jobs=$(nproc)
step() { printf '\n== %s ==\n' "$*"; }

step "release build"
cmake --preset release >/dev/null
cmake --build --preset release -j "$jobs"
step "release tests"
ctest --preset release -j "$jobs"

if [ "${SPIN_SKIP_ASAN:-0}" != 1 ]; then
  step "asan build"
  cmake --preset asan >/dev/null
  cmake --build --preset asan -j "$jobs"
  step "asan tests"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --preset asan -j "$jobs"
fi

if [ "${SPIN_SKIP_FUZZ:-0}" != 1 ]; then
  step "fuzzers"
  cmake --preset fuzz >/dev/null
  cmake --build --preset fuzz -j "$jobs"
  seconds=${SPIN_FUZZ_SECONDS:-60}
  for fuzzer in build/fuzz/fuzz/fuzz_*; do
    name=$(basename "$fuzzer")
    corpus=tests/fuzz/corpus_${name#fuzz_}
    work=$(mktemp -d)
    [ -d "$corpus" ] && cp -r "$corpus"/. "$work"/
    echo "$name: ${seconds}s"
    "$fuzzer" -max_total_time="$seconds" -max_len=4096 -rss_limit_mb=2048 -print_final_stats=1 "$work" 2>&1 | tail -n 3
    rm -rf "$work"
  done
fi
step "all tests passed"
