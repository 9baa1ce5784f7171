#!/usr/bin/env bash
# Session 21, call 6: the overlap experiment again, with the misses fetched apart by the Retrieve
# gather on at most 16 SMs beside the other half's products.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
timeout 120 .gpu-bin/bin/spin_bench_gpu_kernels overlap $OUT/overlap.csv > $OUT/overlap.log 2>&1; echo "== overlap exit $?"; cat $OUT/overlap.log | tail -12
