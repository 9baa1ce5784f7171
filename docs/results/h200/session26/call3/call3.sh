#!/usr/bin/env bash
# Session 26, call 3: the envelope over prefilled ledgers (--context-source ledger) for the other
# rows: Quest and Seer at batch 1, ShadowKV and RetroInfer (their default budgets) at batch 8, 32K.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
start=$SECONDS
common=(--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2
        --decode-context 32768 --context-source ledger)
run() {
  local t=$1 name=$2; shift 2
  local left=$((500 - (SECONDS - start))); [ $left -lt $t ] && t=$left
  [ $t -lt 40 ] && { echo "== $name skipped (time)"; return; }
  local s=$SECONDS
  timeout $t .gpu-bin/bin/spin_bench_model "${common[@]}" "$@" > $OUT/env_$name.md 2>&1; echo "== $name exit $? in $((SECONDS - s)) s"
  grep -a '^| [0-9]\|rror\|^- batch' $OUT/env_$name.md | cut -c1-400
}
run 150 shadowkv_b8_ledger --sparse-algorithm shadowkv --block-size 8 --batch 8
run 180 retroinfer_b8_ledger --sparse-algorithm retroinfer --batch 8
run 70 quest_b1_ledger --sparse-algorithm quest --sparse-budget 512 --batch 1
run 70 seer_b1_ledger --sparse-algorithm seer --sparse-budget 512 --batch 1
