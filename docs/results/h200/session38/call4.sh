#!/usr/bin/env bash
# Session 38's fourth call: where the tensor-core product loses to session 37's kernel (build
# "final"): "mma2" is call 3's, "mma3" the same with its products in two chains of accumulation.
# spin_bench_gpu_kernels products (new here) of each build: each product of a Llama-3.1-8B and a
# Qwen3-14B layer and their heads at 1 2 3 4 8 rows, gemv.h against cuBLASLt (final's gemv.h takes
# at most 4 rows); ncu's view of one launch of final's and mma3's kernels (Qwen3-14B's o, 1 row);
# a dense A/B at 32K, cuBLASLt -> mma3 (--gemv-rows 8), Qwen3-14B at batch 1 4 8.
# Usage: call4.sh [SECONDS, 330].
nvidia-smi -L
source scripts/gpu-runs.sh ${1:-330}
T0=$SECONDS
for b in final mma2 mma3; do
  timeout $(run_limit 80) .gpu-bin/$b/spin_bench_gpu_kernels products - > $OUT/products_$b.txt 2>&1
  echo "== products $b exit $? at $((SECONDS - T0)) s"
done
paste -d'|' <(cut -c10-80 $OUT/products_final.txt) <(cut -c56-80 $OUT/products_mma2.txt) \
  <(cut -c56-80 $OUT/products_mma3.txt) | grep -v "copy" | head -100
grep "copy" $OUT/products_mma3.txt
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for b in final mma3; do
  timeout $(run_limit 50) $ncu --clock-control none --kernel-name regex:gemv_nt --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section LaunchStats .gpu-bin/$b/spin_bench_gpu_kernels products - "qwen3-14b o" > $OUT/ncu_$b.txt 2>&1
  echo "== ncu $b exit $? at $((SECONDS - T0)) s"
  grep -a "Duration\|DRAM Throughput\|Warp Cycles Per Issued\|Achieved Occupancy\|Registers Per\|L1/TEX Hit" \
    $OUT/ncu_$b.txt | head -12
done
wrap lt final --gemv-rows 0
wrap mma8 mma3 --gemv-rows 8
ab qwen_lt lt mma8 60 --device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 \
  --decode-context 32768 --model qwen3-14b --batch 1 4 8
rm -f $OUT/ab_*.txt
