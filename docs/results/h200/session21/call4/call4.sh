#!/usr/bin/env bash
# Session 21, call 4: the sparse envelope at batch 16, 32K for RetroInfer.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
common=(--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2)
run() { local t=$1 name=$2; shift 2; timeout $t .gpu-bin/bin/spin_bench_model "${common[@]}" "$@" > $OUT/env_$name.md 2>&1; echo "== $name exit $?"; grep '^| [0-9]' $OUT/env_$name.md; }
run 500 retroinfer_32k_b16 --decode-context 32768 --batch 16 --sparse-algorithm retroinfer
