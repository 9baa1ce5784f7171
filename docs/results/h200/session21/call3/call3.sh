#!/usr/bin/env bash
# Session 21, call 3: the sparse envelope at batch 16, 32K for ShadowKV, and Quest at batch 4,
# 128K (87 GB of pinned host tier each).
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
common=(--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2)
run() { local t=$1 name=$2; shift 2; timeout $t .gpu-bin/bin/spin_bench_model "${common[@]}" "$@" > $OUT/env_$name.md 2>&1; echo "== $name exit $?"; grep '^| [0-9]' $OUT/env_$name.md; }
run 280 shadowkv_32k_b16 --decode-context 32768 --batch 16 --sparse-algorithm shadowkv --block-size 8
run 280 quest_128k_b4 --decode-context 131072 --batch 4 --sparse-algorithm quest --sparse-budget 2048
