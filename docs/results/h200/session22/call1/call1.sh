#!/usr/bin/env bash
# Session 22, call 1: the GPU tests (with the split-step test and the bounded fetch's trace test),
# then Quest at batch 16, 32K, whole steps against steps in two halves (same binary, alternating).
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
timeout 150 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1; echo "== tests exit $?"
grep -E "FAILED|PASSED|SKIPPED \]|Failure|error" $OUT/gpu_tests.log | head -20
common=(--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2 --decode-context 32768 --batch 16 --sparse-algorithm quest --sparse-budget 512)
for v in split whole; do
  extra=(); [ $v = split ] && extra=(--split-decode-rows 16)
  timeout 200 .gpu-bin/bin/spin_bench_model "${common[@]}" "${extra[@]}" > $OUT/quest_b16_$v.md 2>&1; echo "== $v exit $?"
  grep -E '^\| [0-9]|^steps' $OUT/quest_b16_$v.md
done
