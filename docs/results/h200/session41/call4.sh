#!/usr/bin/env bash
# Session 41's fourth call, on the H100 call 3 left warm: Quest's envelope rows of call 3 again at
# batch 1 and 8 only (call 3's run of three batches ran out of time during batch 16, before its
# breakdown table). Usage: call4.sh [SECONDS, 200].
source scripts/gpu-runs.sh ${1:-200}
mkdir -p .gpu-bin/bin && ln -sf ../s41/spin_bench_model .gpu-bin/bin/spin_bench_model
bench quest_ledger_b1_8 190 --device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 \
  --decode-tokens 16 --repeats 2 --context-source ledger --sparse-budget 512 --sparse-algorithm quest --batch 1 8
