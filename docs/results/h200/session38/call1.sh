#!/usr/bin/env bash
# Session 38's first call: session 37's landed build (.gpu-bin/gz/final/, 99f50dd's tree; staged as
# session37/call3.sh says) on whatever GPU comes. Usage: call1.sh [SECONDS, 480]. In order of need:
# all GPU tests; dense A/Bs at 32K from cuBLASLt (--gemv-rows 0) to the default (2), batch 1 2,
# Llama-3.1-8B then Qwen3-14B; Quest over prefilled ledgers, the same pair, batch 1 and 8 (1 and 4
# on an 80 GB card); Seer the same at batch 1. The sparse rows print the envelope of each side.
nvidia-smi -L
source scripts/gpu-runs.sh ${1:-480}
gpu_tests final 80
wrap lt final --gemv-rows 0
dense="--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --decode-context 32768"
ab dense_llama lt final 60 $dense --model llama-3.1-8b --batch 1 2
ab dense_qwen lt final 60 $dense --model qwen3-14b --batch 1 2
wide=8
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || wide=4
ledger="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 16
        --repeats 2 --context-source ledger --sparse-budget 512"
ab quest_ledger lt final 200 $ledger --sparse-algorithm quest --batch 1 $wide
ab seer_ledger lt final 110 $ledger --sparse-algorithm seer --batch 1
