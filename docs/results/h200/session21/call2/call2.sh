#!/usr/bin/env bash
# Session 21, call 2: dense decode attention at pages of 16, 32 and 64 tokens against cuDNN (same
# call), then the whole dense model at --block-size 16 and 64 side by side.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
timeout 150 .gpu-bin/bin/spin_bench_gpu_kernels dense $OUT/spin_kernels.csv > $OUT/spin_kernels.log 2>&1; echo "== kernels exit $?"
PYTHONUNBUFFERED=1 timeout 150 python3 bench/gpu/sdpa_bench.py --decode-only $OUT/sdpa.csv > $OUT/sdpa.log 2>&1; echo "== sdpa exit $?"
python3 bench/gpu/report.py none $OUT/spin_kernels.csv $OUT/sdpa.csv > $OUT/table.md; sed -n '/dense decode/,/^$/p' $OUT/table.md
common=(--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --batch 1 --decode-context 32768)
n=0
for run in llama-3.1-8b:16 llama-3.1-8b:64 qwen3-14b:16 qwen3-14b:64 llama-3.1-8b:16 llama-3.1-8b:64; do
  m=${run%:*}; bs=${run#*:}; n=$((n+1))
  timeout 90 .gpu-bin/bin/spin_bench_model "${common[@]}" --model $m --block-size $bs > $OUT/dense_${n}_${m}_bs$bs.md 2>&1; echo "== $m block $bs exit $?"; grep '^| [0-9]' $OUT/dense_${n}_${m}_bs$bs.md
done
