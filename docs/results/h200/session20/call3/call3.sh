#!/usr/bin/env bash
# Session 20, call 3: RetroInfer at batch 8 (the breakdown's warm-up capped at 64 M page references
# and its replays kept in eviction order, 1c3994c and b785e79) and Quest at 16x buffers, with the
# fetch in the attention.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
rope='{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}'
common=(--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2)
run() { local t=$1 name=$2; shift 2; timeout $t .gpu-bin/bin/spin_bench_model "${common[@]}" "$@" > $OUT/env_$name.md 2>&1; echo "== $name exit $?"; grep '^| [0-9]' $OUT/env_$name.md; }
run 110 quest16_49k --rope-scaling "$rope" --decode-context 49152 --batch 4 --sparse-algorithm quest --sparse-budget 768 --kv-buffer-factor 16
run 330 retroinfer_32k_b8 --decode-context 32768 --batch 8 --sparse-algorithm retroinfer
