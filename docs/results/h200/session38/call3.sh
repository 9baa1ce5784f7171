#!/usr/bin/env bash
# Session 38's third call: call 2's tensor-core product with its loads of a no longer held back
# behind a branch per step (build "mma2"). Usage: call3.sh [SECONDS, 300]. In order of need: its
# gemv, GEMM and batch-invariance tests; dense A/Bs at 32K, cuBLASLt -> mma2 (--gemv-rows 8) at
# batch 1 2 4 8 and session 37's kernel -> mma2 (both --gemv-rows 2) at batch 1 2, Llama-3.1-8B
# then Qwen3-14B.
nvidia-smi -L
source scripts/gpu-runs.sh ${1:-300}
gpu_tests mma2 60 '*Gemv*:*Gemm*:*BatchInvariant*:*Alone*'
wrap lt final --gemv-rows 0
wrap mma8 mma2 --gemv-rows 8
dense="--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --decode-context 32768"
ab llama_lt lt mma8 70 $dense --model llama-3.1-8b --batch 1 2 4 8
ab qwen_lt lt mma8 80 $dense --model qwen3-14b --batch 1 2 4 8
ab llama_final final mma2 40 $dense --model llama-3.1-8b --batch 1 2
ab qwen_final final mma2 40 $dense --model qwen3-14b --batch 1 2
rm -f $OUT/ab_*.txt
