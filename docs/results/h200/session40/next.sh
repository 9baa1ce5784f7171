#!/usr/bin/env bash
# For the next session's first call. Builds, gzipped into .gpu-bin/gz/BUILD/ (spin_bench_model and
# spin_gpu_tests; carry .gpu-bin and .gpu-deps): land = 3d59c4f (before this session's kernels),
# head = c5bf0fa or later. Usage: next.sh [SECONDS, 540]. All GPU tests of head; session 40's open
# question, Seer at batch 8 land -> head (0.83x in one link-bound run), over random pages and over
# prefilled ledgers; on an H200, the envelope rows of issue 5 with head.
nvidia-smi -L
source scripts/gpu-runs.sh ${1:-540}
gpu_tests head 100
mkdir -p .gpu-bin/bin && ln -sf ../head/spin_bench_model .gpu-bin/bin/spin_bench_model
q="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 16
   --repeats 2 --sparse-budget 512 --sparse-algorithm seer --batch 8"
ab seer_random land head 90 $q
ab seer_ledger land head 150 $q --context-source ledger
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  ledger="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 16
          --repeats 2 --context-source ledger --sparse-budget 512"
  bench quest_ledger 150 $ledger --sparse-algorithm quest --batch 1 8 16
fi
rm -f $OUT/ab_*.txt
