#!/usr/bin/env bash
# Session 17, call 2: call 1's sweep (full LongBench-v2 prompt lengths, outputs at half length,
# 8 requests at 0.05 and at 1 req/s) for Quest with 16x buffers; then the same model's decode step
# outside the server at about the serving batch and context (Quest 16x at batch 4, dense at batch 2,
# 49152 tokens), to compare with the server's step time.
chmod +x .gpu-bin/*/*
rope='{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}'
SPIN_GPU_PREBUILT=.gpu-bin SPIN_SERVE_SCALE=1 SPIN_SERVE_OUTPUT_SCALE=0.5 SPIN_SERVE_PROMPTS=8 SPIN_SERVE_RATES="0.05 1" \
  SPIN_SERVE_DEVICE_GB=24 SPIN_SERVE_MAX_LEN=131072 SPIN_SERVE_ROPE_SCALING="$rope" SPIN_SERVE_MODES="quest:16" \
  SPIN_SERVE_SECONDS=420 SPIN_SERVE_REQUEST_TIMEOUT=400 timeout 440 bash scripts/gpu-serve-bench.sh 2>&1 | tail -12
source scripts/gpu-deps-env.sh
common=(--device cuda --load-format dummy --model qwen3-14b --rope-scaling "$rope" --prefill 16 --decode-tokens 16 --repeats 2 --decode-context 49152)
timeout 100 .gpu-bin/bin/spin_bench_model "${common[@]}" --batch 4 --sparse-algorithm quest --sparse-budget 768 --kv-buffer-factor 16 > $OUT/bench_quest16_b4_48k.md 2>&1
timeout 60 .gpu-bin/bin/spin_bench_model "${common[@]}" --batch 2 > $OUT/bench_dense_b2_48k.md 2>&1
tail -n 25 $OUT/bench_quest16_b4_48k.md; tail -n 12 $OUT/bench_dense_b2_48k.md
