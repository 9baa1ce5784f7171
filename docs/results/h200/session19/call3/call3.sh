#!/usr/bin/env bash
# Session 19, call 3: session 18's serving load (8 requests at the full LongBench-v2 prompt lengths,
# outputs at half length, 0.04 req/s with near-regular arrivals, 24 GB device KV pool, 2.5:1 host
# tier) in mode retroinfer with 16x buffers, to stand beside session 18's dense, quest:16 and shadowkv:16.
chmod +x .gpu-bin/*/*
# First, RetroInfer's envelope rows (call 1's run ran out of its 110 s: its caches hit often, so its
# breakdown warms for up to 400 steps).
export CUDA_MODULE_LOADING=EAGER
( source scripts/gpu-deps-env.sh
  timeout 200 .gpu-bin/bin/spin_bench_model --device cuda --load-format dummy --model qwen3-14b --prefill 16 \
    --decode-tokens 16 --repeats 2 --decode-context 32768 --batch 1 8 --sparse-algorithm retroinfer > $OUT/env_retroinfer_32k.md 2>&1
  echo "retroinfer exit $?"; grep '^| [0-9]' $OUT/env_retroinfer_32k.md )
rope='{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}'
SPIN_GPU_PREBUILT=.gpu-bin SPIN_SERVE_SCALE=1 SPIN_SERVE_OUTPUT_SCALE=0.5 SPIN_SERVE_PROMPTS=8 SPIN_SERVE_RATES=0.04 \
  SPIN_SERVE_BURSTINESS=100 SPIN_SERVE_DEVICE_GB=24 SPIN_SERVE_MAX_LEN=131072 SPIN_SERVE_ROPE_SCALING="$rope" \
  SPIN_SERVE_MODES="retroinfer:16" SPIN_SERVE_SECONDS=330 SPIN_SERVE_REQUEST_TIMEOUT=400 timeout 360 bash scripts/gpu-serve-bench.sh 2>&1 | tail -12
