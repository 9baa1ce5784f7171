#!/usr/bin/env bash
# Session 17, call 3: the GPU tests (this session's code: forward counters, the timed device wait),
# then dense-offload at the full LongBench-v2 prompt lengths beside dense and Quest (16x buffers):
# 6 requests at 1 req/s, outputs scaled 0.02 (dense-offload reads every request's whole KV over the
# host link each step, about a second a step at this batch).
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
timeout 200 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1
echo "gpu tests exit $?"; tail -n 4 $OUT/gpu_tests.log
rope='{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}'
SPIN_GPU_PREBUILT=.gpu-bin SPIN_SERVE_SCALE=1 SPIN_SERVE_OUTPUT_SCALE=0.02 SPIN_SERVE_PROMPTS=6 SPIN_SERVE_RATES=1 \
  SPIN_SERVE_DEVICE_GB=24 SPIN_SERVE_MAX_LEN=131072 SPIN_SERVE_ROPE_SCALING="$rope" SPIN_SERVE_MODES="dense quest:16 dense-offload" \
  SPIN_SERVE_SECONDS=240 SPIN_SERVE_REQUEST_TIMEOUT=230 timeout 520 bash scripts/gpu-serve-bench.sh 2>&1 | tail -14
