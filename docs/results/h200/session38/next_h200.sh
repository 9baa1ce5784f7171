#!/usr/bin/env bash
# Prepared in session 38 for the next session with an H200 (not run here: no H200 came). Issue 5's
# open rows on that GPU with session 37's product kernel: all GPU tests; dense at 32K, cuBLASLt
# (--gemv-rows 0) -> the default, batch 1 2; the sparse envelope over prefilled ledgers (session
# 33's settings), Quest side by side at batch 1 and 8, then Seer at 1 and 8, ShadowKV and
# RetroInfer at 1 with the default alone. Batch 8 needs the H200's memory: run with needs_h200.
# Stage the landed build as session37/call3.sh says, into .gpu-bin/gz/final/ (spin_bench_model,
# spin_gpu_tests); carry [".gpu-bin", ".gpu-deps"]. Usage: next_h200.sh [SECONDS, 540].
nvidia-smi -L
source scripts/gpu-runs.sh ${1:-540}
gpu_tests final 80
wrap lt final --gemv-rows 0
mkdir -p .gpu-bin/bin && ln -sf ../final/spin_bench_model .gpu-bin/bin/spin_bench_model
dense="--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --decode-context 32768"
ab dense_llama lt final 40 $dense --model llama-3.1-8b --batch 1 2
ab dense_qwen lt final 40 $dense --model qwen3-14b --batch 1 2
ledger="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 16
        --repeats 2 --context-source ledger"
ab quest_ledger lt final 160 $ledger --sparse-algorithm quest --sparse-budget 512 --batch 1 8
bench seer_ledger 90 $ledger --sparse-algorithm seer --sparse-budget 512 --batch 1 8
bench retroinfer_ledger 60 $ledger --sparse-algorithm retroinfer --batch 1
bench shadowkv_ledger 80 $ledger --sparse-algorithm shadowkv --block-size 8 --batch 1
rm -f $OUT/ab_*.txt
