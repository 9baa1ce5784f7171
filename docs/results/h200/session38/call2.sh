#!/usr/bin/env bash
# Session 38's second call: gemv.h's products on the tensor cores (build "mma", up to 8 rows) against
# session 37's landed kernel (build "final", up to 4 rows, on the CUDA cores) and cuBLASLt. Staged as
# session37/call3.sh says, into .gpu-bin/gz/final/ (99f50dd's tree) and .gpu-bin/gz/mma/ (this
# session's working tree). Usage: call2.sh [SECONDS, 400]. In order of need: mma's gemv and GEMM
# tests, then all its GPU tests; dense A/Bs at 32K, cuBLASLt -> mma at batch 1 2 3 4 8 and
# final -> mma at batch 1 2 (both at --gemv-rows 2), Llama-3.1-8B then Qwen3-14B; Quest over
# prefilled ledgers, cuBLASLt -> mma (--gemv-rows 8), batch 4 (8 on an H200).
nvidia-smi -L
source scripts/gpu-runs.sh ${1:-400}
gpu_tests mma 80
wrap lt final --gemv-rows 0
wrap mma8 mma --gemv-rows 8
dense="--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --decode-context 32768"
ab llama_lt lt mma8 80 $dense --model llama-3.1-8b --batch 1 2 3 4 8
ab qwen_lt lt mma8 90 $dense --model qwen3-14b --batch 1 2 3 4 8
ab llama_final final mma 50 $dense --model llama-3.1-8b --batch 1 2
wide=8
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || wide=4
ab quest_ledger lt mma8 150 --device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 \
  --decode-tokens 16 --repeats 2 --context-source ledger --sparse-budget 512 --sparse-algorithm quest --batch $wide
rm -f $OUT/ab_*.txt
