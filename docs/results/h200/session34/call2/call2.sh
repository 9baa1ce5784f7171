#!/usr/bin/env bash
# Session 34, call 2: call 1 again after its fix (the second member scan's shuffle of the owner's
# missing count sat behind a short-circuit &&: divergent, undefined), with add_lane_rows shared by
# both row loops: all GPU tests; RetroInfer A/B, b6b2041 (base) against the tiled estimation, over
# prefilled ledgers at batch 1 and 8 (4 on an 80 GB card, where 8 does not fit), one round; ncu
# over the new build's ledger steps.
nvidia-smi -L
source scripts/gpu-runs.sh 450
timeout 150 .gpu-bin/tests/spin_gpu_tests > $OUT/gpu_tests.log 2>&1
echo "== gpu tests exit $?"; grep -a "FAILED\|Failure" $OUT/gpu_tests.log | head -8; tail -3 $OUT/gpu_tests.log
grep -a "^\[       OK \]" $OUT/gpu_tests.log | sed 's/.*OK \] \(.*\) (\([0-9]*\) ms)/\2 \1/' | sort -rn | head -5
big=8; [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ] && big=4
m="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 16 --repeats 2"
SPIN_AB_TIMEOUT=130 bash scripts/gpu-ab.sh .gpu-bin/bin/spin_bench_model.base .gpu-bin/bin/spin_bench_model 1 $m \
  --context-source ledger --sparse-algorithm retroinfer --batch 1 $big
mv $OUT/ab.md $OUT/ab_retro_ledger.md
grep -a "^=== \|^| [0-9]* | 32768 | " $OUT/ab_retro_ledger.md | cut -c1-300
n="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 4 --repeats 1"
ncu_bench ncu_retro_ledger 100 4 $n --context-source ledger --sparse-algorithm retroinfer --batch $big
