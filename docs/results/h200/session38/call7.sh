#!/usr/bin/env bash
# Session 38's seventh call: the other two algorithms' envelopes at batch 1 with session 37's
# landed kernel (build "final"), cuBLASLt (--gemv-rows 0) -> the default, over prefilled ledgers
# with session 33's settings. Usage: call7.sh [SECONDS, 170].
nvidia-smi -L
source scripts/gpu-runs.sh ${1:-170}
wrap lt final --gemv-rows 0
ledger="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 16
        --repeats 2 --context-source ledger --batch 1"
ab shadowkv_ledger lt final 70 $ledger --sparse-algorithm shadowkv --block-size 8
ab retroinfer_ledger lt final 100 $ledger --sparse-algorithm retroinfer
