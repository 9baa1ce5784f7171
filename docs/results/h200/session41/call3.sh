#!/usr/bin/env bash
# Session 41's third call (builds as call1.sh says; s41 = 2820b4a), meant for an H200. Usage:
# call3.sh [SECONDS, 360]. Issue 5's envelope rows over prefilled ledgers with s41 (Quest and Seer,
# batch 1 / 8 / 16; last measured on an H200 in session 33, before gemv.h and the shorter select),
# then Llama-3.1-8B dense at batch 1 / 2, cuBLASLt -> gemv.h (80% of the bound there before it).
nvidia-smi -L
source scripts/gpu-runs.sh ${1:-360}
mkdir -p .gpu-bin/bin && ln -sf ../s41/spin_bench_model .gpu-bin/bin/spin_bench_model
ledger="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 16
        --repeats 2 --context-source ledger --sparse-budget 512"
bench quest_ledger 140 $ledger --sparse-algorithm quest --batch 1 8 16
bench seer_ledger 140 $ledger --sparse-algorithm seer --batch 1 8 16
wrap lt s41 --gemv-rows 0
dense="--device cuda --load-format dummy --prefill 16 --decode-context 32768 --decode-tokens 32 --repeats 3"
ab dense_llama lt s41 50 $dense --model llama-3.1-8b --batch 1 2
rm -f $OUT/ab_*.txt
