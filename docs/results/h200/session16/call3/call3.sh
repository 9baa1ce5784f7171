#!/usr/bin/env bash
# Session 16, call 3: GPU tests; decode products sharing one timed cuBLASLt algorithm (A/B, dense and Quest).
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout 200 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"
tail -4 $OUT/gpu_tests.log
grep -E "FAILED|Failure" $OUT/gpu_tests.log | head -20
timeout 60 .gpu-bin/tests/spin_gpu_tests --gtest_filter='GpuGemm*' > $OUT/gpu_tests_gemm.log 2>&1; tail -3 $OUT/gpu_tests_gemm.log
for m in llama-3.1-8b qwen3-14b; do
  mkdir -p $OUT/ab_$m
  OUT=$OUT/ab_$m SPIN_AB_TIMEOUT=100 timeout 280 bash scripts/gpu-ab.sh .gpu-bin/exp/spin_bench_model .gpu-bin/bin/spin_bench_model 2 --device cuda --load-format dummy --model $m --prefill 16 --decode-tokens 32 --repeats 3 --batch 1 8 --decode-context 32768 2>&1 | tail -4
done
mkdir -p $OUT/ab_quest
OUT=$OUT/ab_quest SPIN_AB_TIMEOUT=100 timeout 150 bash scripts/gpu-ab.sh .gpu-bin/exp/spin_bench_model .gpu-bin/bin/spin_bench_model 1 --device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2 --batch 1 8 --decode-context 32768 --sparse-algorithm quest --sparse-budget 512 2>&1 | tail -4
