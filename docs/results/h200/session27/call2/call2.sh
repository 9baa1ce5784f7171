#!/usr/bin/env bash
# Session 27, call 2: on 48310a7, three of session 26's patches (plan_few_victims,
# rmsnorm_held_rows, qk_rope_host_write) and a new select_top (warp-aggregated histogram adds,
# keys held in runs of consecutive candidates so the take pass is one scan), in place of the two
# sparse_select.cu patches that call 1's phase table showed slower. GPU tests, then A/B against
# 48310a7: Quest over ledgers at batch 1 and 8 / 32K (the eager phase table splits the changes:
# select, retrieve = plan, rest = RMSNorm and RoPE), and dense at batch 1 / 32K.
nvidia-smi -L
source scripts/gpu-runs.sh 570
s=$SECONDS
timeout 200 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1
echo "== gpu tests exit $? in $((SECONDS - s)) s"; tail -3 $OUT/gpu_tests.log
ab="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2
    --decode-context 32768 --sparse-algorithm quest --sparse-budget 512 --context-source ledger"
s=$SECONDS
SPIN_AB_TIMEOUT=110 bash scripts/gpu-ab.sh .gpu-bin/exp/spin_bench_model .gpu-bin/bin/spin_bench_model 2 $ab --batch 1 8
mv $OUT/ab.md $OUT/ab_quest.md
echo "== quest a/b in $((SECONDS - s)) s"
s=$SECONDS
dense="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 32 --repeats 3
    --decode-context 32768 --batch 1"
SPIN_AB_TIMEOUT=60 bash scripts/gpu-ab.sh .gpu-bin/exp/spin_bench_model .gpu-bin/bin/spin_bench_model 2 $dense
mv $OUT/ab.md $OUT/ab_dense.md
echo "== dense a/b in $((SECONDS - s)) s"
