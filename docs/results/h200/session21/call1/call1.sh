#!/usr/bin/env bash
# Session 21, call 1: the GPU tests on 6be02fe (the step's fill list cleared and uploaded once),
# then the sparse envelope at batch 16, 32K (87 GB of pinned host tier on a 128 GiB machine).
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
free -g | head -2
timeout 200 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1; echo "== tests exit $?"; tail -3 $OUT/gpu_tests.log
common=(--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2)
run() { local t=$1 name=$2; shift 2; timeout $t .gpu-bin/bin/spin_bench_model "${common[@]}" "$@" > $OUT/env_$name.md 2>&1; echo "== $name exit $?"; grep '^| [0-9]' $OUT/env_$name.md; free -g | sed -n 2p; }
run 250 quest_32k_b16 --decode-context 32768 --batch 16 --sparse-algorithm quest --sparse-budget 512
run 250 seer_32k_b16 --decode-context 32768 --batch 16 --sparse-algorithm seer --sparse-budget 512
