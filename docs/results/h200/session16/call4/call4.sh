#!/usr/bin/env bash
# Session 16, call 4: GPU tests; decode products timed with a read-only L2 flush (A/B); ShadowKV serving with 16x buffers.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
timeout 200 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"
tail -3 $OUT/gpu_tests.log
grep -E "FAILED|Failure" $OUT/gpu_tests.log | head -20
for m in llama-3.1-8b qwen3-14b; do
  mkdir -p $OUT/ab_$m
  OUT=$OUT/ab_$m SPIN_AB_TIMEOUT=100 timeout 200 bash scripts/gpu-ab.sh .gpu-bin/exp/spin_bench_model .gpu-bin/bin/spin_bench_model 2 --device cuda --load-format dummy --model $m --prefill 16 --decode-tokens 32 --repeats 3 --batch 1 8 --decode-context 32768 2>&1 | tail -2
  grep -h "debug" $OUT/ab_$m/ab.md | head -5
done
mkdir -p $OUT/ab_quest
OUT=$OUT/ab_quest SPIN_AB_TIMEOUT=100 timeout 150 bash scripts/gpu-ab.sh .gpu-bin/exp/spin_bench_model .gpu-bin/bin/spin_bench_model 1 --device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2 --batch 1 8 --decode-context 32768 --sparse-algorithm quest --sparse-budget 512 2>&1 | tail -2
rm -rf .gpu-bin/exp
mkdir -p $OUT/serve
rope='{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}'
OUT=$OUT/serve SPIN_GPU_PREBUILT=.gpu-bin SPIN_SERVE_SCALE=1 SPIN_SERVE_OUTPUT_SCALE=1 SPIN_SERVE_PROMPTS=6 SPIN_SERVE_RATES=1 SPIN_SERVE_DEVICE_GB=24 SPIN_SERVE_MAX_LEN=131072 SPIN_SERVE_ROPE_SCALING="$rope" SPIN_SERVE_MODES=shadowkv SPIN_SERVE_BUFFER_FACTOR=16 SPIN_SERVE_SECONDS=190 SPIN_SERVE_REQUEST_TIMEOUT=185 timeout 215 bash scripts/gpu-serve-bench.sh 2>&1 | tail -4
