#!/usr/bin/env bash
# Session 35, call C: the last of the session's device time (under 270 s). The GPU tests of the
# normgemv build that touch what it changes, then dense Qwen3-14B base -> normgemv at batch 1, 32K.
nvidia-smi -L
source docs/results/h200/session34/next/unpack.sh
source scripts/gpu-runs.sh ${1:-150}
timeout $(run_limit 60) .gpu-bin/normgemv/spin_gpu_tests --gtest_brief=1 \
  --gtest_filter='GpuGemv*:GpuGemm*:*CudaModel*:GpuRmsNorm*:GpuModelOps*' > $OUT/gpu_tests_normgemv.log 2>&1
echo "== normgemv gpu tests exit $?"; grep -a "FAILED\|Failure" $OUT/gpu_tests_normgemv.log | head -8; tail -3 $OUT/gpu_tests_normgemv.log
t=$(run_limit 120)
SPIN_AB_TIMEOUT=$((t / 2)) bash scripts/gpu-ab.sh .gpu-bin/base/spin_bench_model .gpu-bin/normgemv/spin_bench_model 1 \
  --device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 32 --repeats 2 \
  --decode-context 32768 --batch 1 > $OUT/ab_dense_qwen_b1.txt 2>&1
mv $OUT/ab.md $OUT/ab_dense_qwen_b1.md; tail -4 $OUT/ab_dense_qwen_b1.txt | cut -c1-250
