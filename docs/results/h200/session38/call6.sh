#!/usr/bin/env bash
# Session 38's sixth call: mma4 (call 5) with the last round of a row stopping at each warp's first
# step past the row's end ("mma6"): a row of 5120 (Qwen3-14B) is a full round and a quarter, and
# mma4 ran every step of the quarter. Usage: call6.sh [SECONDS, 200]. In order of need: its gemv,
# GEMM and batch-invariance tests; spin_bench_gpu_kernels products of final and mma6; dense A/Bs at
# 32K, cuBLASLt -> mma6 (--gemv-rows 8), Qwen3-14B and Llama-3.1-8B at batch 1 2 4 8.
nvidia-smi -L
source scripts/gpu-runs.sh ${1:-200}
gpu_tests mma6 60 '*Gemv*:*Gemm*:*BatchInvariant*:*Alone*'
products 30 final mma6
wrap lt final --gemv-rows 0
wrap m6 mma6 --gemv-rows 8
dense="--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --decode-context 32768"
ab qwen_m6 lt m6 40 $dense --model qwen3-14b --batch 1 2 4 8
ab llama_m6 lt m6 40 $dense --model llama-3.1-8b --batch 1 2 4 8
rm -f $OUT/ab_*.txt
