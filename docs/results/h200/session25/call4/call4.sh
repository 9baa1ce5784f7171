#!/usr/bin/env bash
# Session 25, call 4: batch 64 at 32K (Quest, Seer) with a larger share of the KV pool for the
# first dense layers (call 3: 64 sequences' dense layers did not fit serve's 0.2), and ShadowKV and
# RetroInfer at batch 32 with 95% of the GPU's memory (call 3: their pools ran out of groups).
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
run 100 quest_b64 --batch 64 --sparse-algorithm quest --sparse-budget 512 --dense-layer-share 0.3 --gpu-memory-utilization 0.95
run 100 seer_b64 --batch 64 --sparse-algorithm seer --sparse-budget 512 --dense-layer-share 0.3 --gpu-memory-utilization 0.95
run 100 shadowkv_b32 --batch 32 --sparse-algorithm shadowkv --block-size 8 --gpu-memory-utilization 0.95
run 200 retroinfer_b32 --batch 32 --sparse-algorithm retroinfer --gpu-memory-utilization 0.95
