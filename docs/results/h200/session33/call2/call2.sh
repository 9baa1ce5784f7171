#!/usr/bin/env bash
# Session 33, call 2: all GPU tests (call 1's run hung in the new Seer Index test's layout, whose
# partial-last-block loop never ended at one page a block; fixed), per-test times; Seer's Score
# with four blocks a warp, their loads in flight together (after) against call 1's one block a
# warp (v1), random pages, batch 1 / 8 / 16, one round; the envelope over prefilled ledgers for
# Seer at batch 1, ShadowKV and Quest at batch 8.
nvidia-smi -L
source scripts/gpu-runs.sh 560
timeout 150 .gpu-bin/tests/spin_gpu_tests > $OUT/gpu_tests.log 2>&1
echo "== gpu tests exit $?"; grep -a "FAILED\|Failure" $OUT/gpu_tests.log | head -8; tail -3 $OUT/gpu_tests.log
grep -a "^\[       OK \]" $OUT/gpu_tests.log | sed 's/.*OK \] \(.*\) (\([0-9]*\) ms)/\2 \1/' | sort -rn | head -6
m="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 16 --repeats 2"
SPIN_AB_TIMEOUT=100 bash scripts/gpu-ab.sh .gpu-bin/bin/spin_bench_model.v1 .gpu-bin/bin/spin_bench_model 1 $m \
  --sparse-algorithm seer --sparse-budget 512 --batch 1 8 16
mv $OUT/ab.md $OUT/ab_seer_tiles.md
grep -a "^| [0-9]* | 32768 | 14 " $OUT/ab_seer_tiles.md | cut -d'|' -f2,5,6 
bench seer_b1_ledger 60 $m --context-source ledger --sparse-algorithm seer --sparse-budget 512 --batch 1
bench shadowkv_b8_ledger 80 $m --context-source ledger --sparse-algorithm shadowkv --block-size 8 --batch 8
bench quest_b8_ledger 80 $m --context-source ledger --sparse-algorithm quest --sparse-budget 512 --batch 8
