#!/usr/bin/env bash
# Session 18, call 7: the breakdown now runs right before the timed graph steps (its warm-up fills
# the caches), so the ideal and the measured step come from adjacent windows. Quest, 5x at 32K
# (batch 1 and 8) and 16x at 49152 (batch 4).
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
rope='{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}'
common=(--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2)
timeout 70 .gpu-bin/bin/spin_bench_model "${common[@]}" --decode-context 32768 --batch 1 8 --sparse-algorithm quest --sparse-budget 512 > $OUT/env_quest_32k.md 2>&1
echo "exit $?"; grep '^| [0-9]' $OUT/env_quest_32k.md
timeout 70 .gpu-bin/bin/spin_bench_model "${common[@]}" --rope-scaling "$rope" --decode-context 49152 --batch 4 --sparse-algorithm quest --sparse-budget 768 --kv-buffer-factor 16 > $OUT/env_quest16_49k.md 2>&1
echo "exit $?"; grep '^| [0-9]' $OUT/env_quest16_49k.md
