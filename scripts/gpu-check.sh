#!/usr/bin/env bash
# Runs on the GPU machine in ONE call: unpacks the carried Debian packages (scripts/gpu-deps.sh),
# builds spin for sm_90, runs every GPU test, and prints a short table last.
# Results go to $OUT (when set) so they come back with the call.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/spin-gpu-out}
mkdir -p "$out"
deps=/tmp/spin-deps
mkdir -p "$deps"
for f in .gpu-deps/*.deb; do dpkg-deb -x "$f" "$deps"; done
export PKG_CONFIG_PATH=$deps/usr/lib/x86_64-linux-gnu/pkgconfig:$deps/usr/share/pkgconfig
export PKG_CONFIG_SYSROOT_DIR=$deps
export LD_LIBRARY_PATH=$deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"

cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPIN_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DSPIN_DEPS_ROOT="$deps" -DCMAKE_PREFIX_PATH="$deps/usr" \
  >"$out/configure.log" 2>&1 || { tail -n 40 "$out/configure.log"; exit 1; }
cmake --build build/gpu -j "$(nproc)" >"$out/build.log" 2>&1 || { grep -m 20 -E 'error' "$out/build.log"; tail -n 20 "$out/build.log"; exit 1; }

status=0
build/gpu/tests/spin_gpu_tests --gtest_output=json:"$out/gpu_tests.json" 2>&1 | tee "$out/gpu_tests.log" || status=1

printf '\n| check | result |\n|---|---|\n'
python3 - "$out/gpu_tests.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
for suite in report["testsuites"]:
    for t in suite["testsuite"]:
        ok = "failures" not in t and t.get("result") != "SKIPPED"
        print(f"| {suite['name']}.{t['name']} | {'pass' if ok else 'FAIL'} ({t['time']}) |")
PY
exit $status
