#!/usr/bin/env bash
# Session 38's fifth call: the tensor-core product with its loads addressed by offsets from one
# pointer a round ("mma4"; call 4's ncu and SASS showed mma3 bound by instruction issue, 488 a
# round a warp, most of them address arithmetic), and the same with two buffers of pieces in turn
# instead of a copy between them ("mma5"). Usage: call5.sh [SECONDS, 240]. In order of need: mma4's
# gemv, GEMM and batch-invariance tests; spin_bench_gpu_kernels products of final, mma4 and mma5;
# dense A/Bs at 32K, cuBLASLt -> mma4 and mma5 (--gemv-rows 8), batch 1 4 8.
nvidia-smi -L
source scripts/gpu-runs.sh ${1:-240}
gpu_tests mma4 60 '*Gemv*:*Gemm*:*BatchInvariant*:*Alone*'
products 60 final mma4 mma5
wrap lt final --gemv-rows 0
wrap m4 mma4 --gemv-rows 8
wrap m5 mma5 --gemv-rows 8
dense="--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --decode-context 32768"
ab qwen_m4 lt m4 40 $dense --model qwen3-14b --batch 1 4 8
ab qwen_m5 lt m5 40 $dense --model qwen3-14b --batch 1 4 8
ab llama_m4 lt m4 40 $dense --model llama-3.1-8b --batch 1 4 8
rm -f $OUT/ab_*.txt
