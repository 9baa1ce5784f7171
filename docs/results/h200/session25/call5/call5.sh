#!/usr/bin/env bash
# Session 25, call 5: the GPU tests (the KV pool now leaves room for the page summaries), then
# ShadowKV and RetroInfer at batch 32 and 64, 32K, over the 16 GB repeated backing: first at their
# default 2048-token budget (the benchmark's fit check now counts the buffers, call 4's runs ran
# out of groups), then at 512 tokens, 1.56% of 32K as issue 5 asks.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
start=$SECONDS
timeout 220 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1; echo "== tests exit $? in $((SECONDS - start)) s"; tail -4 $OUT/gpu_tests.log
common=(--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2
        --decode-context 32768 --host-tier-backing 16 --gpu-memory-utilization 0.95)
run() {
  local t=$1 name=$2; shift 2
  local left=$((585 - (SECONDS - start))); [ $left -lt $t ] && t=$left
  [ $t -lt 25 ] && { echo "== $name skipped (time)"; return; }
  local s=$SECONDS
  timeout $t .gpu-bin/bin/spin_bench_model "${common[@]}" "$@" > $OUT/env_$name.md 2>&1; echo "== $name exit $? in $((SECONDS - s)) s"
  grep '^| [0-9]\|KV pool\|rror' $OUT/env_$name.md | cut -c1-400
}
run 40 shadowkv_b32_2048 --batch 32 --sparse-algorithm shadowkv --block-size 8
run 90 shadowkv_b32_512 --batch 32 --sparse-algorithm shadowkv --block-size 8 --sparse-budget 512
run 120 retroinfer_b32_512 --batch 32 --sparse-algorithm retroinfer --sparse-budget 512
run 100 shadowkv_b64_512 --batch 64 --sparse-algorithm shadowkv --block-size 8 --sparse-budget 512 --dense-layer-share 0.3
run 150 retroinfer_b64_512 --batch 64 --sparse-algorithm retroinfer --sparse-budget 512 --dense-layer-share 0.3
