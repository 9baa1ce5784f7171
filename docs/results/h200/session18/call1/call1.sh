#!/usr/bin/env bash
# Session 18, call 1: the GPU tests (session 17's device-wait assertion has not run on a GPU yet);
# then sparse decode steps with the bench's timing now taken once the caches are full: Quest with
# 16x buffers at serving's shape (49152 tokens, budget 768, batch 4 and 6), and the envelope
# rows (Quest, 5x buffers, budget 512, batch 1 and 8 at 32K) beside session 13's.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt
timeout 200 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1
echo "gpu tests exit $?"; tail -n 4 $OUT/gpu_tests.log
rope='{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}'
common=(--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2)
timeout 150 .gpu-bin/bin/spin_bench_model "${common[@]}" --rope-scaling "$rope" --decode-context 49152 --batch 4 6 \
  --sparse-algorithm quest --sparse-budget 768 --kv-buffer-factor 16 > $OUT/bench_quest16_49k.md 2>&1
timeout 120 .gpu-bin/bin/spin_bench_model "${common[@]}" --decode-context 32768 --batch 1 8 \
  --sparse-algorithm quest --sparse-budget 512 > $OUT/bench_quest5_32k.md 2>&1
for f in bench_quest16_49k bench_quest5_32k; do grep '^| [0-9]' $OUT/$f.md; done
