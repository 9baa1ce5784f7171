#!/usr/bin/env bash
# Session 39's first call. Builds (gzipped in .gpu-bin/gz/BUILD/, made as session37/call3.sh says):
#   final  582659c, main at the session's start (kernels/cuda/gemv.h: four outputs a group two
#          pieces deep, an early exit per depth past a row's end; default --gemv-rows 2)
#   n6     final's gemv.cu without the early exit (the loads of a issue together; pieces past the
#          row's end are zeros) and, from 3 rows on, six outputs a group one piece deep
#   n8     n6 with eight outputs a group from 3 rows on (spills 24 / 100 bytes at 3 / 4 rows)
#   cs     n6 with its loads of w kept out of L1 (ld.global.nc.L1::no_allocate), which then holds
#          the rows of a that every group re-reads
#   c8     cs taking up to 8 rows (kMaxGemvRows 8): four outputs a group one piece deep from 5 on
# Usage: call1.sh [SECONDS, 560]. In order of need: n6's gemv, GEMM and batch-invariance tests;
# spin_bench_gpu_kernels products of the five builds; dense A/Bs at 32K, final at its default ->
# n6 at --gemv-rows 4, batch 1 2 3 4; Qwen3-14B at batch 4 8, cuBLASLt -> c8 at --gemv-rows 8;
# Quest over prefilled ledgers, final -> n6 at 4 rows, batch 1 4.
nvidia-smi -L
source scripts/gpu-runs.sh ${1:-560}
gpu_tests n6 60 '*Gemv*:*Gemm*:*BatchInvariant*:*Alone*'
products 25 final n6 n8 cs c8
mkdir -p .gpu-bin/bin && ln -sf ../final/spin_bench_model .gpu-bin/bin/spin_bench_model
wrap n4 n6 --gemv-rows 4
wrap c8r c8 --gemv-rows 8
wrap lt final --gemv-rows 0
dense="--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --decode-context 32768"
ab dense_llama final n4 50 $dense --model llama-3.1-8b --batch 1 2 3 4
ab dense_qwen final n4 50 $dense --model qwen3-14b --batch 1 2 3 4
ab dense_qwen_c8 lt c8r 50 $dense --model qwen3-14b --batch 4 8
ledger="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 16
        --repeats 2 --context-source ledger --sparse-budget 512"
ab quest_ledger final n4 200 $ledger --sparse-algorithm quest --batch 1 4
rm -f $OUT/ab_*.txt
