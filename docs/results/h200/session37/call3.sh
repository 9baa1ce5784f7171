#!/usr/bin/env bash
# Session 37's third call: the landed build (.gpu-bin/gz/final/: kernels/cuda/gemv.h with four
# outputs a group on resident blocks, kMaxGemvRows 4, kDefaultGemvRows 2, the tight-pool tests on
# one product path). Usage: call3.sh [SECONDS, 200]: all GPU tests, then dense A/Bs at 32K from
# cuBLASLt (--gemv-rows 0) to the default, batch 1 2 3, Llama-3.1-8B then Qwen3-14B.
# Staged here (carry [".gpu-bin", ".gpu-deps"]; scripts/gpu-deps.sh for the second):
#   cmake -S . -B build/h200 -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPIN_CUDA=ON \
#     -DCMAKE_CUDA_ARCHITECTURES=90a -DSPIN_BENCH=ON && ninja -C build/h200 spin_bench_model spin_gpu_tests
#   mkdir -p .gpu-bin/gz/final && for b in bin/spin_bench_model tests/spin_gpu_tests; do
#     gzip -c build/h200/$b > .gpu-bin/gz/final/$(basename $b).gz; done
nvidia-smi -L
source scripts/gpu-runs.sh ${1:-200}
T0=$SECONDS
timeout 70 .gpu-bin/final/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1
echo "== gpu tests exit $? in $((SECONDS - T0)) s"; grep -a "FAILED\|Failure" $OUT/gpu_tests.log | head -8
tail -3 $OUT/gpu_tests.log
wrap lt final --gemv-rows 0
dense="--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --decode-context 32768"
ab dense_llama lt final 60 $dense --model llama-3.1-8b --batch 1 2 3
ab dense_qwen lt final 60 $dense --model qwen3-14b --batch 1 2 3
