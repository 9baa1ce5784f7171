#!/usr/bin/env bash
# Session 22, call 4: the split step with the halves taking turns (a half's stretch of compute
# waits for the other's). GPU tests, then Quest and Seer at batch 16, 32K, in two halves and whole.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
timeout 150 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1; echo "== tests exit $?"
grep -E "FAILED|PASSED|SKIPPED \]|Failure" $OUT/gpu_tests.log | head -20
common=(--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2 --decode-context 32768 --batch 16 --sparse-budget 512)
for a in quest seer; do
  for v in split whole; do
    extra=(); [ $v = split ] && extra=(--split-decode-rows 16)
    timeout 150 .gpu-bin/bin/spin_bench_model "${common[@]}" --sparse-algorithm $a "${extra[@]}" > $OUT/${a}_b16_$v.md 2>&1; echo "== $a $v exit $?"
    grep -E '^\| [0-9]|^steps' $OUT/${a}_b16_$v.md
  done
done
