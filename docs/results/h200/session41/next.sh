#!/usr/bin/env bash
# For the next session's first call. Builds gzipped into .gpu-bin/gz/BUILD/ (spin_bench_model,
# spin_gpu_tests, spin_bench_gpu_kernels; carry .gpu-bin and .gpu-deps): main = 2820b4a (ed4a20b),
# q8 = branch quest-8bit-summaries (Quest's summaries as 8-bit codes, never run on a GPU).
# Usage: next.sh [SECONDS, 540]. In order of need: the GPU tests of q8 (all of them: the branch
# changes the Quest Index and score kernels and mma.cuh); the score kernel alone, main -> q8
# (`step 32K`); Quest over prefilled ledgers main -> q8 at batch 8 and 16 (one process a batch);
# on an H200 also issue 5's envelope rows with main (Quest and Seer at batch 1, Seer at 8).
nvidia-smi -L
source scripts/gpu-runs.sh ${1:-540}
gpu_tests q8 90
for b in main q8; do
  time_for "step $b" 40 || continue
  timeout "$t" .gpu-bin/$b/spin_bench_gpu_kernels step "$OUT/step_$b.csv" 32K >/dev/null 2>&1
  echo "== step $b exit $?"; grep -a "score\|select" "$OUT/step_$b.csv"
done
ledger="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 16
        --repeats 2 --context-source ledger --sparse-budget 512"
ab quest8 main q8 110 $ledger --sparse-algorithm quest --batch 8
ab quest16 main q8 110 $ledger --sparse-algorithm quest --batch 16
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  mkdir -p .gpu-bin/bin && ln -sf ../main/spin_bench_model .gpu-bin/bin/spin_bench_model
  bench quest_ledger 70 $ledger --sparse-algorithm quest --batch 1
  bench seer_ledger 110 $ledger --sparse-algorithm seer --batch 1 8
fi
rm -f $OUT/ab_*.txt
