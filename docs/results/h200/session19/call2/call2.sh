#!/usr/bin/env bash
# Session 19, call 2: session 18's serving load (8 requests at the full LongBench-v2 prompt lengths,
# outputs at half length, 0.04 req/s with near-regular arrivals, 24 GB device KV pool, 2.5:1 host
# tier) in mode seer with 16x buffers, to stand beside session 18's dense, quest:16 and shadowkv:16.
chmod +x .gpu-bin/*/*
# First, dense Llama-3.1-8B at batch 1, 32K (81% of its bound in session 10, the one shape under
# the 83%), re-measured on today's build.
export CUDA_MODULE_LOADING=EAGER
( source scripts/gpu-deps-env.sh
  timeout 100 .gpu-bin/bin/spin_bench_model --device cuda --load-format dummy --model llama-3.1-8b --prefill 16 \
    --decode-tokens 32 --repeats 3 --batch 1 --decode-context 32768 131072 > $OUT/llama_dense_b1.md 2>&1
  echo "llama exit $?"; grep '^| [0-9]' $OUT/llama_dense_b1.md )
rope='{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}'
SPIN_GPU_PREBUILT=.gpu-bin SPIN_SERVE_SCALE=1 SPIN_SERVE_OUTPUT_SCALE=0.5 SPIN_SERVE_PROMPTS=8 SPIN_SERVE_RATES=0.04 \
  SPIN_SERVE_BURSTINESS=100 SPIN_SERVE_DEVICE_GB=24 SPIN_SERVE_MAX_LEN=131072 SPIN_SERVE_ROPE_SCALING="$rope" \
  SPIN_SERVE_MODES="seer:16" SPIN_SERVE_SECONDS=420 SPIN_SERVE_REQUEST_TIMEOUT=400 timeout 470 bash scripts/gpu-serve-bench.sh 2>&1 | tail -12
