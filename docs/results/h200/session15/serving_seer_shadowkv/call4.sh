#!/usr/bin/env bash
# Session 15, call 4: the sparse and page-cache GPU tests on the final build, then Seer and
# ShadowKV served at the full LongBench-v2 shape.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
timeout 60 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 --gtest_filter='CudaSparse*:GpuPageCache*:GpuShadowKv*:GpuRetroInfer*' > $OUT/gpu_tests_sparse.log 2>&1; echo "tests rc $?"
tail -3 $OUT/gpu_tests_sparse.log
grep -E "FAILED|Failure" $OUT/gpu_tests_sparse.log | head -10
SPIN_GPU_PREBUILT=.gpu-bin SPIN_SERVE_MODES="seer shadowkv" SPIN_SERVE_SCALE=1 SPIN_SERVE_OUTPUT_SCALE=1 SPIN_SERVE_PROMPTS=6 SPIN_SERVE_RATES=1 SPIN_SERVE_DEVICE_GB=24 SPIN_SERVE_MAX_LEN=131072 SPIN_SERVE_ROPE_SCALING='{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}' SPIN_SERVE_SECONDS=250 SPIN_SERVE_REQUEST_TIMEOUT=245 bash scripts/gpu-serve-bench.sh 2>&1 | grep -v "requests done"
rm -f $OUT/serve_*.log.tmp
