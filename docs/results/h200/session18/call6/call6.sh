#!/usr/bin/env bash
# Session 18, call 6: does the store's hit rate still move after call 4's ~105 steps? Quest at
# batch 1 and 8, 32K, 5x buffers, with 4x as many timed steps (64 x 2) before the breakdown.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
timeout 200 .gpu-bin/bin/spin_bench_model --device cuda --load-format dummy --model qwen3-14b --prefill 16 \
  --decode-tokens 64 --repeats 2 --decode-context 32768 --batch 1 8 --sparse-algorithm quest --sparse-budget 512 > $OUT/env_quest_32k_long.md 2>&1
echo "exit $?"; grep '^| [0-9]' $OUT/env_quest_32k_long.md
