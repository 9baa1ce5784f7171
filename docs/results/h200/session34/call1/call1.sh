#!/usr/bin/env bash
# Session 34, call 1: all GPU tests with RetroInfer's estimation in tiles of 32 clusters a warp
# (and session 33's work-based Seer tile pick); RetroInfer A/B, b6b2041 (base) against it, over
# prefilled ledgers at batch 1 and 8, one round; ncu over the new build's ledger steps at batch 8.
nvidia-smi -L
source scripts/gpu-runs.sh 550
timeout 150 .gpu-bin/tests/spin_gpu_tests > $OUT/gpu_tests.log 2>&1
echo "== gpu tests exit $?"; grep -a "FAILED\|Failure" $OUT/gpu_tests.log | head -8; tail -3 $OUT/gpu_tests.log
grep -a "^\[       OK \]" $OUT/gpu_tests.log | sed 's/.*OK \] \(.*\) (\([0-9]*\) ms)/\2 \1/' | sort -rn | head -5
m="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 16 --repeats 2"
SPIN_AB_TIMEOUT=130 bash scripts/gpu-ab.sh .gpu-bin/bin/spin_bench_model.base .gpu-bin/bin/spin_bench_model 1 $m \
  --context-source ledger --sparse-algorithm retroinfer --batch 1 8
mv $OUT/ab.md $OUT/ab_retro_ledger.md
grep -a "^| [0-9]* | 32768 | " $OUT/ab_retro_ledger.md | cut -d'|' -f2,5,6,7,8,9,10,11,12,17 
n="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 4 --repeats 1"
ncu_bench ncu_retro_b8_ledger 150 4 $n --context-source ledger --sparse-algorithm retroinfer --batch 8
