#!/usr/bin/env bash
# Prepared in session 34, not run there (no device time left): the next session's first call.
# Run from the repository root as `bash docs/results/h200/session34/next/callA.sh`, carrying
# [".gpu-bin", ".gpu-deps"]. All GPU tests of `both`; dense A/B base -> gemv at 32K (Qwen3-14B and
# Llama-3.1-8B, batch 1 and 8, one round); RetroInfer's microbenchmark for base and retro.
nvidia-smi -L
source docs/results/h200/session34/next/unpack.sh
source scripts/gpu-runs.sh 560
timeout 150 .gpu-bin/both/spin_gpu_tests > $OUT/gpu_tests.log 2>&1
echo "== gpu tests exit $?"; grep -a "FAILED\|Failure" $OUT/gpu_tests.log | head -8; tail -3 $OUT/gpu_tests.log
for model in qwen3-14b llama-3.1-8b; do
  dense="--device cuda --load-format dummy --model $model --prefill 16 --decode-tokens 32 --repeats 3
      --decode-context 32768 --batch 1 8"
  SPIN_AB_TIMEOUT=70 bash scripts/gpu-ab.sh .gpu-bin/base/spin_bench_model .gpu-bin/gemv/spin_bench_model 1 $dense
  mv $OUT/ab.md $OUT/ab_dense_$model.md
done
for b in base retro; do
  timeout 90 .gpu-bin/$b/spin_bench_gpu_kernels retro $OUT/retro_$b.csv > $OUT/retro_$b.log 2>&1
  echo "== retro microbenchmark, $b: exit $?"; grep -a "^retro\|rror" $OUT/retro_$b.log
done
