#!/usr/bin/env bash
# Session 18, call 5: calls 2 and 3's load (8 requests at the full LongBench-v2 prompt lengths,
# outputs at half length, 0.04 req/s with near-regular arrivals: gamma shape 100) for ShadowKV
# with 16x buffers.
chmod +x .gpu-bin/*/*
rope='{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}'
SPIN_GPU_PREBUILT=.gpu-bin SPIN_SERVE_SCALE=1 SPIN_SERVE_OUTPUT_SCALE=0.5 SPIN_SERVE_PROMPTS=8 SPIN_SERVE_RATES=0.04 \
  SPIN_SERVE_BURSTINESS=100 SPIN_SERVE_DEVICE_GB=24 SPIN_SERVE_MAX_LEN=131072 SPIN_SERVE_ROPE_SCALING="$rope" \
  SPIN_SERVE_MODES="shadowkv:16" SPIN_SERVE_SECONDS=420 SPIN_SERVE_REQUEST_TIMEOUT=400 timeout 560 bash scripts/gpu-serve-bench.sh 2>&1 | tail -12
