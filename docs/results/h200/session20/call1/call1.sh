#!/usr/bin/env bash
# Session 20, call 1: the GPU tests with the fetch in the attention (new kernel tests), and
# Quest / Seer / RetroInfer envelope rows with the fetch in the attention vs before it, side by side.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
timeout 200 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1
echo "gpu tests exit $?"; grep -E "FAILED|Failure" $OUT/gpu_tests.log | head -20; tail -n 4 $OUT/gpu_tests.log
common=(--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2)
b32=(--decode-context 32768 --batch 1 8)
run() { local t=$1 name=$2; shift 2; timeout $t .gpu-bin/bin/spin_bench_model "${common[@]}" "$@" > $OUT/env_$name.md 2>&1; echo "== $name exit $?"; grep '^| [0-9]' $OUT/env_$name.md; }
run 110 quest_32k_in_attention "${b32[@]}" --sparse-algorithm quest --sparse-budget 512
run 110 quest_32k_separate "${b32[@]}" --sparse-algorithm quest --sparse-budget 512 --no-fetch-in-attention
run 110 seer_32k_in_attention "${b32[@]}" --sparse-algorithm seer --sparse-budget 512
run 60 retroinfer_32k_b1_in_attention --decode-context 32768 --batch 1 --sparse-algorithm retroinfer
run 60 retroinfer_32k_b1_separate --decode-context 32768 --batch 1 --sparse-algorithm retroinfer --no-fetch-in-attention
