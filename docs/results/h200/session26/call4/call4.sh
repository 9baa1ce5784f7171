#!/usr/bin/env bash
# Session 26, call 4: more envelope rows over prefilled ledgers (--context-source ledger): ShadowKV
# and RetroInfer at batch 1, Seer at batch 16 (32K), Quest at batch 1 and 128K.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
start=$SECONDS
common=(--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2
        --context-source ledger)
run() {
  local t=$1 name=$2; shift 2
  local left=$((330 - (SECONDS - start))); [ $left -lt $t ] && t=$left
  [ $t -lt 30 ] && { echo "== $name skipped (time)"; return; }
  local s=$SECONDS
  timeout $t .gpu-bin/bin/spin_bench_model "${common[@]}" "$@" > $OUT/env_$name.md 2>&1; echo "== $name exit $? in $((SECONDS - s)) s"
  grep -a '^| [0-9]\|rror\|^- batch' $OUT/env_$name.md | cut -c1-400
}
run 60 shadowkv_b1_ledger --decode-context 32768 --sparse-algorithm shadowkv --block-size 8 --batch 1
run 60 retroinfer_b1_ledger --decode-context 32768 --sparse-algorithm retroinfer --batch 1
run 90 quest_b1_128k_ledger --decode-context 131072 --sparse-algorithm quest --sparse-budget 2048 --batch 1
run 150 seer_b16_ledger --decode-context 32768 --sparse-algorithm seer --sparse-budget 512 --batch 16
