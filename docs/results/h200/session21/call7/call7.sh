#!/usr/bin/env bash
# Session 21, call 7: the committed kernel benchmark (one helper for page lists and decode
# parameters) on two dense shapes and the overlap experiment, to check it runs as documented.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
timeout 100 .gpu-bin/bin/spin_bench_gpu_kernels dense $OUT/dense.csv "B1 ctx32K" > $OUT/dense.log 2>&1; echo "== dense exit $?"; grep -E "^dense" $OUT/dense.log
timeout 100 .gpu-bin/bin/spin_bench_gpu_kernels overlap $OUT/overlap.csv > $OUT/overlap.log 2>&1; echo "== overlap exit $?"; grep -E "^overlap" $OUT/overlap.log
