#!/usr/bin/env bash
# Session 33, call 5 (the same warm H200): eb5b207 (before) against this session's build (after)
# over prefilled ledgers, one round: Seer at batch 8, ShadowKV at batch 8 (32K).
nvidia-smi -L
source scripts/gpu-runs.sh 300
m="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 16 --repeats 2
   --context-source ledger --batch 8"
SPIN_AB_TIMEOUT=60 bash scripts/gpu-ab.sh .gpu-bin/bin/spin_bench_model.before .gpu-bin/bin/spin_bench_model 1 $m \
  --sparse-algorithm seer --sparse-budget 512
mv $OUT/ab.md $OUT/ab_seer_b8_ledger.md
SPIN_AB_TIMEOUT=90 bash scripts/gpu-ab.sh .gpu-bin/bin/spin_bench_model.before .gpu-bin/bin/spin_bench_model 1 $m \
  --sparse-algorithm shadowkv --block-size 8
mv $OUT/ab.md $OUT/ab_shadowkv_b8_ledger.md
grep -a "^| 8 | 32768 | [0-9]* | " $OUT/ab_*.md | cut -d'|' -f1,2,5,6,17
