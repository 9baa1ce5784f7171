#!/usr/bin/env bash
# Session 33, call 3 (the H200 of call 2, still warm): the envelope over prefilled ledgers with
# this session's build (call 2's "after"): Seer at batch 8 and 16, Quest at 1 and 16, ShadowKV at
# 1, RetroInfer at 1 and 8 (32K, session 26's settings).
nvidia-smi -L
source scripts/gpu-runs.sh 470
m="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 16 --repeats 2
   --context-source ledger"
bench seer_b8_ledger 70 $m --sparse-algorithm seer --sparse-budget 512 --batch 8
bench quest_b1_ledger 60 $m --sparse-algorithm quest --sparse-budget 512 --batch 1
bench shadowkv_b1_ledger 60 $m --sparse-algorithm shadowkv --block-size 8 --batch 1
bench retroinfer_b1_ledger 60 $m --sparse-algorithm retroinfer --batch 1
bench retroinfer_b8_ledger 80 $m --sparse-algorithm retroinfer --batch 8
bench seer_b16_ledger 120 $m --sparse-algorithm seer --sparse-budget 512 --batch 16
bench quest_b16_ledger 100 $m --sparse-algorithm quest --sparse-budget 512 --batch 16
