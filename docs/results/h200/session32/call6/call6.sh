#!/usr/bin/env bash
# Session 32, call 6: Quest's scores on the tensor cores (a tile of 16 summary rows [min | max]
# times the group's [min(q, 0) | max(q, 0)], mma m16n8k16). All GPU tests, then A/B against
# c64b726, Quest over random pages, batch 1 and 8 / 32K, one round (call 5's settings).
nvidia-smi -L
source scripts/gpu-runs.sh 200
chmod +x .gpu-bin/bin/*
timeout 70 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1
echo "== gpu tests exit $?"; grep -a "FAILED\|Failure" $OUT/gpu_tests.log | head -5; tail -3 $OUT/gpu_tests.log
q="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --sparse-algorithm quest
   --sparse-budget 512 --decode-tokens 16 --repeats 2 --batch 1 8"
SPIN_AB_TIMEOUT=60 bash scripts/gpu-ab.sh .gpu-bin/bin/spin_bench_model.before .gpu-bin/bin/spin_bench_model 1 $q
mv $OUT/ab.md $OUT/ab_quest.md
grep -a "index+score" -A3 $OUT/ab_quest.md | cut -c1-120
