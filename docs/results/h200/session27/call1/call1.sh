#!/usr/bin/env bash
# Session 27, call 1: the GPU tests with session 26's five patches applied (on 48310a7), and Quest
# over prefilled ledgers at batch 1 and 8, 32K: 48310a7 (before) against the patches (after).
source scripts/gpu-runs.sh 560
s=$SECONDS
timeout 200 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1
echo "== gpu tests exit $? in $((SECONDS - s)) s"; tail -6 $OUT/gpu_tests.log
ab="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2
    --decode-context 32768 --sparse-algorithm quest --sparse-budget 512 --context-source ledger"
SPIN_AB_TIMEOUT=120 bash scripts/gpu-ab.sh .gpu-bin/exp/spin_bench_model .gpu-bin/bin/spin_bench_model 2 $ab --batch 1 8
