#!/usr/bin/env bash
# Session 27, call 3: the GPU tests on 7024939, then the envelope over prefilled ledgers with
# teacher forcing (`--context-source ledger-text`: decode feeds the ledger's own continuation), its
# first run, Quest beside `ledger` (greedy tokens fed back) in the same call; then Seer, ShadowKV
# and RetroInfer over ledger-text: batch 1 and 8 at 32K (ShadowKV and RetroInfer batch 1 only).
nvidia-smi -L
source scripts/gpu-runs.sh 540
s=$SECONDS
timeout 200 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1
echo "== gpu tests exit $? in $((SECONDS - s)) s"; tail -3 $OUT/gpu_tests.log
common="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2
        --decode-context 32768"
bench quest_ledger_text 130 $common --batch 1 8 --sparse-algorithm quest --sparse-budget 512 --context-source ledger-text
bench quest_ledger 130 $common --batch 1 8 --sparse-algorithm quest --sparse-budget 512 --context-source ledger
bench seer_ledger_text 130 $common --batch 1 8 --sparse-algorithm seer --sparse-budget 512 --context-source ledger-text
bench shadowkv_ledger_text 90 $common --batch 1 --sparse-algorithm shadowkv --block-size 8 --context-source ledger-text
bench retroinfer_ledger_text 90 $common --batch 1 --sparse-algorithm retroinfer --context-source ledger-text
