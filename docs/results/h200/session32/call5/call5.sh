#!/usr/bin/env bash
# Session 32, call 5: Quest's scores with the queries held once (q * (q > 0 ? max : min)) instead of
# split by sign, and compiled for 3 blocks per SM (80 registers at group <= 5, no spills; call 4's
# ncu: 128 registers, 25% occupancy, 0.4 instructions issued per scheduler cycle). Score tests,
# then A/B against c64b726, Quest over random pages, batch 1 and 8 / 32K, one round.
nvidia-smi -L
source scripts/gpu-runs.sh 230
chmod +x .gpu-bin/bin/*
timeout 40 .gpu-bin/tests/spin_gpu_tests --gtest_filter='GpuQuestScore*:GpuSparseSelect*:GpuSelectTop*' --gtest_brief=1 > $OUT/score_tests.log 2>&1
echo "== score tests exit $?"; tail -1 $OUT/score_tests.log
q="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --sparse-algorithm quest
   --sparse-budget 512 --decode-tokens 16 --repeats 2 --batch 1 8"
SPIN_AB_TIMEOUT=90 bash scripts/gpu-ab.sh .gpu-bin/bin/spin_bench_model.before .gpu-bin/bin/spin_bench_model 1 $q
mv $OUT/ab.md $OUT/ab_quest.md
grep -a "index+score" -A3 $OUT/ab_quest.md | cut -c1-120
