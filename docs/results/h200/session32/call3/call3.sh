#!/usr/bin/env bash
# Session 32, call 3: Quest's scores through shared memory, now one wave of blocks (call 2's grid
# made 1.2 waves at batch 8). Score tests; ncu per kernel, before and after, Quest over ledgers at
# batch 8; then A/B at batch 1 and 8, one round.
nvidia-smi -L
source scripts/gpu-runs.sh 570
chmod +x .gpu-bin/bin/*
timeout 60 .gpu-bin/tests/spin_gpu_tests --gtest_filter='GpuQuestScore*:GpuSparseSelect*:GpuSelectTop*' --gtest_brief=1 > $OUT/score_tests.log 2>&1
echo "== score tests exit $?"; tail -1 $OUT/score_tests.log
q="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --sparse-algorithm quest
   --sparse-budget 512 --context-source ledger"
cp .gpu-bin/bin/spin_bench_model /tmp/after
cp .gpu-bin/bin/spin_bench_model.before .gpu-bin/bin/spin_bench_model
ncu_bench ncu_before_b8 150 4 $q --decode-tokens 4 --repeats 1 --batch 8 | head -20
cp /tmp/after .gpu-bin/bin/spin_bench_model
ncu_bench ncu_after_b8 150 4 $q --decode-tokens 4 --repeats 1 --batch 8 | head -20
SPIN_AB_TIMEOUT=110 bash scripts/gpu-ab.sh .gpu-bin/bin/spin_bench_model.before .gpu-bin/bin/spin_bench_model 1 $q --decode-tokens 16 --repeats 2 --batch 1 8
mv $OUT/ab.md $OUT/ab_quest.md
grep -a "index+score" -A3 $OUT/ab_quest.md | cut -c1-120
