#!/usr/bin/env bash
# Session 22, call 2: why the split step did not overlap. Quest at batch 16, 32K, in two halves,
# with an experimental build: the fetch's grid (SPIN_EXP_FETCH_BLOCKS) and the halves' fetches on
# one Retrieve stream (in turn) or two (SPIN_EXP_TWO_STREAMS).
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
common=(--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2 --decode-context 32768 --batch 16 --sparse-algorithm quest --sparse-budget 512 --split-decode-rows 16)
run() { local name=$1; shift; env "$@" timeout 150 .gpu-bin/exp/spin_bench_model "${common[@]}" > $OUT/quest_b16_$name.md 2>&1; echo "== $name exit $?"; grep -E '^\| [0-9]|^steps' $OUT/quest_b16_$name.md; }
run blocks132 SPIN_EXP_FETCH_BLOCKS=132
run blocks264 SPIN_EXP_FETCH_BLOCKS=264
run blocks132_two SPIN_EXP_FETCH_BLOCKS=132 SPIN_EXP_TWO_STREAMS=1
run blocks32_two SPIN_EXP_FETCH_BLOCKS=32 SPIN_EXP_TWO_STREAMS=1
