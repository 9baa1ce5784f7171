#!/usr/bin/env bash
# Session 25, call 3: the sparse envelope at batch 32 and 64, 32K, each algorithm, over a 16 GB
# repeated host-tier backing (call 2: batch 8 backed and own within 0.5%). The KV pool now leaves
# room for the page summaries (call 2's batch 64 ran out of GPU memory making them).
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
start=$SECONDS
common=(--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2
        --decode-context 32768 --host-tier-backing 16)
run() {
  local t=$1 name=$2; shift 2
  local left=$((580 - (SECONDS - start))); [ $left -lt $t ] && t=$left
  [ $t -lt 30 ] && { echo "== $name skipped (time)"; return; }
  local s=$SECONDS
  timeout $t .gpu-bin/bin/spin_bench_model "${common[@]}" "$@" > $OUT/env_$name.md 2>&1; echo "== $name exit $? in $((SECONDS - s)) s"
  grep '^| [0-9]\|KV pool\|rror' $OUT/env_$name.md | cut -c1-400
}
run 90 quest_b64 --batch 64 --sparse-algorithm quest --sparse-budget 512
run 60 seer_b32 --batch 32 --sparse-algorithm seer --sparse-budget 512
run 90 seer_b64 --batch 64 --sparse-algorithm seer --sparse-budget 512
run 90 shadowkv_b32 --batch 32 --sparse-algorithm shadowkv --block-size 8
run 150 retroinfer_b32 --batch 32 --sparse-algorithm retroinfer
run 120 shadowkv_b64 --batch 64 --sparse-algorithm shadowkv --block-size 8
run 200 retroinfer_b64 --batch 64 --sparse-algorithm retroinfer
