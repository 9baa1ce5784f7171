#!/usr/bin/env bash
# Session 39's second call, on call 1's warm machine and builds (call1.sh names them). Usage:
# call2.sh [SECONDS, 240]: spin_bench_gpu_kernels products of final, n6, cs and c8 (call 1 gave
# them 25 s each, under gpu-runs.sh's 30 s floor, so they were skipped); dense A/Bs at 32K, n6 ->
# cs at the default 2 rows, batch 1 2, Qwen3-14B then Llama-3.1-8B.
nvidia-smi -L
source scripts/gpu-runs.sh ${1:-240}
products 35 final n6 cs c8
mkdir -p .gpu-bin/bin && ln -sf ../final/spin_bench_model .gpu-bin/bin/spin_bench_model
dense="--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --decode-context 32768"
ab dense_qwen_cs n6 cs 40 $dense --model qwen3-14b --batch 1 2
ab dense_llama_cs n6 cs 40 $dense --model llama-3.1-8b --batch 1 2
rm -f $OUT/ab_*.txt
