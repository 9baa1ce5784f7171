#!/usr/bin/env bash
# Builds the GPU binaries here (sm_90; no GPU needed) and stages them in .gpu-bin/ for the device
# call: `run` with carry [".gpu-bin", ".gpu-deps"] and SPIN_GPU_PREBUILT=.gpu-bin bash scripts/gpu-check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build/h200 -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPIN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
  -DSPIN_BENCH=ON >/dev/null
targets=(spin spin_gpu_tests spin_bench_gpu_kernels spin_bench_model)
ninja -C build/h200 -j "${JOBS:-2}" "${targets[@]}"
rm -rf .gpu-bin && mkdir -p .gpu-bin/bin .gpu-bin/tests
cp build/h200/bin/spin build/h200/bin/spin_bench_gpu_kernels build/h200/bin/spin_bench_model .gpu-bin/bin/
cp build/h200/tests/spin_gpu_tests .gpu-bin/tests/
du -sh .gpu-bin
