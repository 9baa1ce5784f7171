#!/usr/bin/env bash
# Runs on the GPU machine in ONE call: unpacks the carried Debian packages (scripts/gpu-deps.sh),
# builds spin for sm_90, runs every GPU test, runs the GPU kernel benchmarks (spin's kernels and
# PyTorch SDPA on the same shapes), and prints a short table last (bench/gpu/report.py).
# SPIN_GPU_BENCH=0 skips the benchmarks (=kernels or =model runs only that part);
# SPIN_GPU_KERNELS=<dense|sparse|gather|prefill|step|overlap|retro|products> runs one kernel benchmark (default all; the
# PyTorch side runs with all only);
# SPIN_GPU_FILTER=<gtest filter> runs only those GPU tests.
# SPIN_GPU_PREBUILT=<dir> uses binaries built elsewhere (scripts/gpu-prebuild.sh: bin/, tests/)
# instead of building here, which saves the device minutes of compiling.
# Results go to $OUT (when set) so they come back with the call.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/spin-gpu-out}
mkdir -p "$out"
source scripts/gpu-deps-env.sh
export PKG_CONFIG_PATH=$deps/usr/lib/x86_64-linux-gnu/pkgconfig:$deps/usr/share/pkgconfig
export PKG_CONFIG_SYSROOT_DIR=$deps
# On a machine with 2+ GPUs the tensor-parallel tests run too; they need kernels loaded eagerly
# (kernels/cuda/module_loading.h) and NVLink multicast off.
export CUDA_MODULE_LOADING=EAGER NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"

bin=build/gpu
if [ -n "${SPIN_GPU_PREBUILT:-}" ]; then
  bin=$SPIN_GPU_PREBUILT
  chmod +x "$bin"/bin/* "$bin"/tests/* 2>/dev/null || true
else
  cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPIN_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DSPIN_DEPS_ROOT="$deps" -DCMAKE_PREFIX_PATH="$deps/usr" \
    >"$out/configure.log" 2>&1 || { tail -n 40 "$out/configure.log"; exit 1; }
  cmake --build build/gpu -j "$(nproc)" >"$out/build.log" 2>&1 || { grep -m 20 -E 'error' "$out/build.log"; tail -n 20 "$out/build.log"; exit 1; }
fi

status=0
timeout 300 $bin/tests/spin_gpu_tests --gtest_filter="${SPIN_GPU_FILTER:-*}" --gtest_output=json:"$out/gpu_tests.json" 2>&1 | tee "$out/gpu_tests.log" || status=1

bench=${SPIN_GPU_BENCH:-1}
if [ "$bench" = 1 ] || [ "$bench" = kernels ]; then
  echo "== spin kernel benchmarks"
  kernels=${SPIN_GPU_KERNELS:-all}
  $bin/bin/spin_bench_gpu_kernels "$kernels" "$out/spin_kernels.csv" 2>&1 | tee "$out/spin_kernels.log" || status=1
  if [ "$kernels" = all ]; then
    echo "== PyTorch SDPA on the same shapes"
    PYTHONUNBUFFERED=1 python3 bench/gpu/sdpa_bench.py "$out/sdpa.csv" 2>&1 | tee "$out/sdpa.log" || status=1
  fi
fi
if [ "$bench" = 1 ] || [ "$bench" = model ]; then
  # The bf16 forward pass on dummy weights made on the device: decode tok/s against the bytes a
  # step must read over the measured device copy bandwidth, then CUDA graphs off for the A/B.
  echo "== spin model benchmark (GPU forward pass)"
  model_bench=($bin/bin/spin_bench_model --device cuda --load-format dummy --decode-tokens 32 --repeats 3)
  "${model_bench[@]}" --model qwen3-14b --batch 1 8 32 --decode-context 1024 8192 32768 --prefill 512 4096 \
    2>&1 | tee "$out/model_qwen3-14b.md" || status=1
  "${model_bench[@]}" --model llama-3.1-8b --batch 1 8 32 --decode-context 1024 8192 --prefill 4096 \
    2>&1 | tee "$out/model_llama-3.1-8b.md" || status=1
  "${model_bench[@]}" --model qwen3-14b --no-cuda-graphs --batch 1 8 --decode-context 1024 --prefill 512 \
    2>&1 | tee "$out/model_qwen3-14b_no_graphs.md" || status=1
  echo "== HF transformers generate on the same dummy shapes (external peer)"
  PYTHONUNBUFFERED=1 python3 bench/gpu/hf_generate_bench.py --preset qwen3-14b --batch 1 8 32 --context 1024 \
    --new-tokens 32 --csv "$out/hf_qwen3-14b.csv" 2>&1 | tee "$out/hf_qwen3-14b.log" || status=1
fi

python3 bench/gpu/report.py "$out/gpu_tests.json" "$out/spin_kernels.csv" "$out/sdpa.csv" | tee "$out/table.md"
exit $status
