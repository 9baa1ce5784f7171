#!/usr/bin/env bash
# Session 26, call 1: the GPU tests on b435783 + the two RetroInfer patches (covers the driver
# entry-point refactor, first GPU run), then RetroInfer at batch 8 / 32K A/B: b435783 (before) vs
# the patches (after), 2 rounds alternating.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
s=$SECONDS
timeout 200 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.txt 2>&1; echo "== tests exit $? in $((SECONDS - s)) s"
tail -5 $OUT/gpu_tests.txt; grep -a "FAILED\|Failure" $OUT/gpu_tests.txt | head -20
s=$SECONDS
SPIN_AB_TIMEOUT=110 bash scripts/gpu-ab.sh .gpu-bin/exp/spin_bench_model_base .gpu-bin/bin/spin_bench_model 2 \
  --device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2 \
  --decode-context 32768 --sparse-algorithm retroinfer --host-tier-backing 8 --batch 8
echo "== ab exit $? in $((SECONDS - s)) s"
grep -a "^===\|^| 8 " $OUT/ab.md | cut -c1-300
