#!/usr/bin/env bash
# Session 27, call 4: Quest over ledger-text (teacher forcing) at batch 16 / 32K and batch 1 / 128K
# (2048-token budget), on 7024939.
nvidia-smi -L
source scripts/gpu-runs.sh 270
common="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2
        --sparse-algorithm quest --context-source ledger-text"
bench quest_ledger_text_b16 130 $common --sparse-budget 512 --decode-context 32768 --batch 16
bench quest_ledger_text_128k 130 $common --sparse-budget 2048 --decode-context 131072 --batch 1
