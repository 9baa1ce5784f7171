#!/usr/bin/env bash
# Session 39's third call. Builds: final (call1.sh) and land, the working tree to land: call 2's
# "cs" (gemv.h without the early exit per depth, w's loads bypassing L1, six outputs a group one
# piece deep from 3 rows on) with its comments updated. Usage: call3.sh [SECONDS, 480]. In order of
# need: all GPU tests of land; dense A/Bs at 32K, cuBLASLt (--gemv-rows 0) -> land's default, batch
# 1 2. On an H100: why a step of 3-4 rows loses on gemv.h while its products alone win at 3 rows
# (call 2): cuBLASLt -> land at --gemv-rows 4, Llama-3.1-8B batch 3 4, with and without
# programmatic launches (SPIN_PROGRAMMATIC_LAUNCH=0), and each side's kernels under ncu at batch 3
# (bench/gpu/ncu_summary.py's table: kernels alone, caches flushed). On an H200: issue 5's open rows there with land (the sparse envelope over
# prefilled ledgers, Quest and Seer at batch 1 and 8).
nvidia-smi -L
source scripts/gpu-runs.sh ${1:-480}
gpu_tests land 90
wrap lt land --gemv-rows 0
wrap l4 land --gemv-rows 4
mkdir -p .gpu-bin/bin && ln -sf ../land/spin_bench_model .gpu-bin/bin/spin_bench_model
dense="--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --decode-context 32768"
ab dense_llama lt land 40 $dense --model llama-3.1-8b --batch 1 2
ab dense_qwen lt land 40 $dense --model qwen3-14b --batch 1 2
ledger="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 16
        --repeats 2 --context-source ledger --sparse-budget 512"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bench quest_ledger 140 $ledger --sparse-algorithm quest --batch 1 8
  bench seer_ledger 140 $ledger --sparse-algorithm seer --batch 1 8
else
  ab llama_b34 lt l4 40 $dense --model llama-3.1-8b --batch 3 4
  export SPIN_PROGRAMMATIC_LAUNCH=0
  ab llama_b34_plain lt l4 40 $dense --model llama-3.1-8b --batch 3 4
  unset SPIN_PROGRAMMATIC_LAUNCH
  short="--device cuda --load-format dummy --prefill 16 --decode-tokens 2 --repeats 1 --decode-context 32768"
  ncu_bench ncu_llama_b3_lt 50 2 $short --model llama-3.1-8b --batch 3 --gemv-rows 0
  ncu_bench ncu_llama_b3_l4 50 2 $short --model llama-3.1-8b --batch 3 --gemv-rows 4
fi
rm -f $OUT/ab_*.txt
