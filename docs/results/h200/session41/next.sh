#!/usr/bin/env bash
# For the next session's first call. Builds gzipped into .gpu-bin/gz/BUILD/ (spin_bench_model and
# spin_gpu_tests; carry .gpu-bin and .gpu-deps): head = 2820b4a or later. Usage: next.sh [SECONDS,
# 540]. All GPU tests of head; on an H200, issue 5's envelope rows over prefilled ledgers (Quest and
# Seer, batch 1 / 8 / 16, each batch its own run so that a slow one does not take the others) and
# Llama-3.1-8B dense at batch 1 / 2, cuBLASLt -> gemv.h; on an H100 only the tests.
nvidia-smi -L
source scripts/gpu-runs.sh ${1:-540}
gpu_tests head 90
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || exit 0
mkdir -p .gpu-bin/bin && ln -sf ../head/spin_bench_model .gpu-bin/bin/spin_bench_model
ledger="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 16
        --repeats 2 --context-source ledger --sparse-budget 512"
bench quest_ledger 110 $ledger --sparse-algorithm quest --batch 1 8
bench seer_ledger 110 $ledger --sparse-algorithm seer --batch 1 8
bench quest_ledger16 70 $ledger --sparse-algorithm quest --batch 16
bench seer_ledger16 70 $ledger --sparse-algorithm seer --batch 16
wrap lt head --gemv-rows 0
dense="--device cuda --load-format dummy --prefill 16 --decode-context 32768 --decode-tokens 32 --repeats 3"
ab dense_llama lt head 50 $dense --model llama-3.1-8b --batch 1 2
rm -f $OUT/ab_*.txt
