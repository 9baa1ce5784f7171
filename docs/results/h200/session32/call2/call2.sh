#!/usr/bin/env bash
# Session 32, call 2: Quest's scores staged through shared memory by cp.async (units of 32
# pages, 4 in flight per block) instead of loads into registers. Score tests, then the kernel
# bench's sparse layer (before / after binaries), then A/B of Quest over ledgers at batch 1 and 8.
nvidia-smi -L
source scripts/gpu-runs.sh 570
chmod +x .gpu-bin/bin/*
s=$SECONDS
timeout 60 .gpu-bin/tests/spin_gpu_tests --gtest_filter='GpuQuestScore*:GpuSparseSelect*:GpuSelectTop*' --gtest_brief=1 > $OUT/score_tests.log 2>&1
echo "== score tests exit $? in $((SECONDS - s)) s"; grep -a "FAILED\|Failure" $OUT/score_tests.log | head; tail -2 $OUT/score_tests.log
for b in before after; do
  s=$SECONDS
  timeout 100 .gpu-bin/bin/kernels.$b sparse $OUT/kernels_$b.csv > $OUT/kernels_$b.log 2>&1
  echo "== kernels $b exit $? in $((SECONDS - s)) s"; grep -a "sparse score\|sparse total" $OUT/kernels_$b.log | head -12
done
ab="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2
    --decode-context 32768 --sparse-algorithm quest --sparse-budget 512 --context-source ledger"
s=$SECONDS
SPIN_AB_TIMEOUT=110 bash scripts/gpu-ab.sh .gpu-bin/bin/spin_bench_model.before .gpu-bin/bin/spin_bench_model 2 $ab --batch 1 8
mv $OUT/ab.md $OUT/ab_quest.md
echo "== quest a/b in $((SECONDS - s)) s"
grep -a "^| 1 \|^| 8 " $OUT/ab_quest.md | grep -a "quest\|Quest" | head -8
