#!/usr/bin/env bash
# Session 18, call 4: every algorithm's envelope rows (batch 1 and 8 at 32K, default 5x buffers) and
# Quest with 16x buffers at serving's shape, with the breakdown's replay now warmed for
# 6 x (1 + buffer factor) steps and an LRU replay beside Belady's (does the replay's LRU reach the
# store's measured hit rate, i.e. is the replay warm?).
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
rope='{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}'
common=(--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2)
b32=(--decode-context 32768 --batch 1 8)
run() { local name=$1; shift; timeout 150 .gpu-bin/bin/spin_bench_model "${common[@]}" "$@" > $OUT/env_$name.md 2>&1; echo "== $name exit $?"; grep '^| [0-9]' $OUT/env_$name.md | tail -n 2; }
run quest_32k "${b32[@]}" --sparse-algorithm quest --sparse-budget 512
run seer_32k "${b32[@]}" --sparse-algorithm seer --sparse-budget 512
run shadowkv_32k "${b32[@]}" --sparse-algorithm shadowkv --block-size 8
run retroinfer_32k "${b32[@]}" --sparse-algorithm retroinfer
run quest16_49k --rope-scaling "$rope" --decode-context 49152 --batch 4 6 --sparse-algorithm quest --sparse-budget 768 --kv-buffer-factor 16
