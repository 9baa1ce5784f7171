#!/usr/bin/env bash
# Session 17, call 1: a request-rate sweep at the full LongBench-v2 prompt lengths, dense. Outputs at
# half their LongBench-v2 length (mean ~2.7K) so two rates fit one call: 0.05 req/s (about the rate
# dense's 24 GB pool sustains at these lengths) and 1 req/s (all requests at once).
chmod +x .gpu-bin/*/*
rope='{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}'
SPIN_GPU_PREBUILT=.gpu-bin SPIN_SERVE_SCALE=1 SPIN_SERVE_OUTPUT_SCALE=0.5 SPIN_SERVE_PROMPTS=8 SPIN_SERVE_RATES="0.05 1" \
  SPIN_SERVE_DEVICE_GB=24 SPIN_SERVE_MAX_LEN=131072 SPIN_SERVE_ROPE_SCALING="$rope" SPIN_SERVE_MODES="${MODES:-dense}" \
  SPIN_SERVE_SECONDS=${SECONDS_PER_MODE:-540} SPIN_SERVE_REQUEST_TIMEOUT=420 timeout 570 bash scripts/gpu-serve-bench.sh 2>&1 | tail -12
