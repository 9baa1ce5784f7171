#!/usr/bin/env bash
# Session 16, call 1: GPU tests; graphs with node priorities (ShadowKV A/B); Quest serving at buffer 16.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout 200 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"
tail -4 $OUT/gpu_tests.log
grep -E "FAILED|Failure" $OUT/gpu_tests.log | head -20
grep -c "TraceMatchesCpuPolicyWithValuesOnlyMisses" $OUT/gpu_tests.log
mkdir -p $OUT/ab_shadowkv
OUT=$OUT/ab_shadowkv SPIN_AB_TIMEOUT=100 timeout 300 bash scripts/gpu-ab.sh .gpu-bin/exp/spin_bench_model .gpu-bin/bin/spin_bench_model 2 --device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2 --batch 1 8 --decode-context 32768 --sparse-algorithm shadowkv --block-size 8 2>&1 | tail -8
rm -rf .gpu-bin/exp
mkdir -p $OUT/serve
OUT=$OUT/serve SPIN_GPU_PREBUILT=.gpu-bin SPIN_SERVE_MODES="quest" SPIN_SERVE_SCALE=1 SPIN_SERVE_OUTPUT_SCALE=1 SPIN_SERVE_PROMPTS=6 SPIN_SERVE_RATES=1 SPIN_SERVE_DEVICE_GB=24 SPIN_SERVE_MAX_LEN=131072 SPIN_SERVE_ROPE_SCALING='{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}' SPIN_SERVE_SECONDS=230 SPIN_SERVE_REQUEST_TIMEOUT=225 SPIN_SERVE_BUFFER_FACTOR=16 timeout 270 bash scripts/gpu-serve-bench.sh 2>&1 | tail -15
