#!/usr/bin/env bash
# Session 16, call 2: the full LongBench-v2 shape, dense beside Quest with 16x buffers, one call.
chmod +x .gpu-bin/*/*
common=(SPIN_GPU_PREBUILT=.gpu-bin SPIN_SERVE_SCALE=1 SPIN_SERVE_OUTPUT_SCALE=1 SPIN_SERVE_PROMPTS=6 SPIN_SERVE_RATES=1 SPIN_SERVE_DEVICE_GB=24 SPIN_SERVE_MAX_LEN=131072)
rope='{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}'
mkdir -p $OUT/dense $OUT/sparse
env "${common[@]}" OUT=$OUT/dense SPIN_SERVE_ROPE_SCALING="$rope" SPIN_SERVE_MODES=dense SPIN_SERVE_SECONDS=245 SPIN_SERVE_REQUEST_TIMEOUT=240 timeout 280 bash scripts/gpu-serve-bench.sh 2>&1 | tail -3
env "${common[@]}" OUT=$OUT/sparse SPIN_SERVE_ROPE_SCALING="$rope" SPIN_SERVE_MODES=quest SPIN_SERVE_BUFFER_FACTOR=16 SPIN_SERVE_SECONDS=200 SPIN_SERVE_REQUEST_TIMEOUT=195 timeout 230 bash scripts/gpu-serve-bench.sh 2>&1 | tail -5
