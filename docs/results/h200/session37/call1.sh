#!/usr/bin/env bash
# Session 37's first call, carrying .gpu-bin/gz/ (gzipped builds of main 72b9f4d plus the uncommitted
# decode-sized product patch; session34/next/unpack.sh's layout):
#   gemv8  = kernels/cuda/gemv.h's instances for 1..8 rows, two outputs a block; spin_bench_model
#            --gemv-rows N sends the products of at most N rows to it, 0 none (all on cuBLASLt);
#   gemv8o = the same with four outputs a block from 3 rows on (outs_for in gemv.cu).
# Usage: call1.sh [SECONDS the call may run, 500]. In order of need:
#   GPU tests of gemv8 (all) and gemv8o (the gemv and GEMM ones);
#   dense at 32K, one binary: cuBLASLt (--gemv-rows 0) -> gemv (--gemv-rows 8), batch 1 2 3 4 6 8,
#   Qwen3-14B; then two against four outputs a block at batch 3 4 6 8; then Llama-3.1-8B as the first.
nvidia-smi -L
source scripts/gpu-runs.sh ${1:-500}
T0=$SECONDS
wrap lt gemv8 --gemv-rows 0
wrap g8 gemv8 --gemv-rows 8
wrap o8 gemv8o --gemv-rows 8
timeout 150 .gpu-bin/gemv8/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests_gemv8.log 2>&1
echo "== gemv8 gpu tests exit $? in $((SECONDS - T0)) s"; grep -a "FAILED\|Failure" $OUT/gpu_tests_gemv8.log | head -8
tail -3 $OUT/gpu_tests_gemv8.log
timeout 40 .gpu-bin/gemv8o/spin_gpu_tests --gtest_brief=1 --gtest_filter='*Gemv*:*Gemm*' \
  > $OUT/gpu_tests_gemv8o.log 2>&1
echo "== gemv8o gemv/GEMM tests exit $?"; grep -a "FAILED\|Failure" $OUT/gpu_tests_gemv8o.log | head -8
tail -2 $OUT/gpu_tests_gemv8o.log
dense="--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --decode-context 32768"
ab dense_qwen lt g8 150 $dense --model qwen3-14b --batch 1 2 3 4 6 8
ab dense_qwen_outs g8 o8 120 $dense --model qwen3-14b --batch 3 4 6 8
ab dense_llama lt g8 130 $dense --model llama-3.1-8b --batch 1 2 3 4 6 8
