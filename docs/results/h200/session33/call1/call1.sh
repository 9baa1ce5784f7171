#!/usr/bin/env bash
# Session 33, call 1: Seer's complete blocks scored from one ready entry (the Index keeps each
# block's running sum and, at its last page, the key turned to its centre), and ShadowKV's pass-1
# logits on the tensor cores. All GPU tests; A/B against eb5b207 over random pages (Seer batch
# 1 / 8 / 16, ShadowKV batch 1 / 8, one round); then Seer's envelope over prefilled ledgers.
nvidia-smi -L
source scripts/gpu-runs.sh 560
timeout 90 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1
echo "== gpu tests exit $?"; grep -a "FAILED\|Failure" $OUT/gpu_tests.log | head -8; tail -3 $OUT/gpu_tests.log
m="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 16 --repeats 2"
SPIN_AB_TIMEOUT=100 bash scripts/gpu-ab.sh .gpu-bin/bin/spin_bench_model.before .gpu-bin/bin/spin_bench_model 1 $m \
  --sparse-algorithm seer --sparse-budget 512 --batch 1 8 16
mv $OUT/ab.md $OUT/ab_seer.md
SPIN_AB_TIMEOUT=80 bash scripts/gpu-ab.sh .gpu-bin/bin/spin_bench_model.before .gpu-bin/bin/spin_bench_model 1 $m \
  --sparse-algorithm shadowkv --block-size 8 --batch 1 8
mv $OUT/ab.md $OUT/ab_shadowkv.md
bench seer_b8_ledger 90 $m --context-source ledger --sparse-algorithm seer --sparse-budget 512 --batch 8
bench seer_b16_ledger 150 $m --context-source ledger --sparse-algorithm seer --sparse-budget 512 --batch 16
