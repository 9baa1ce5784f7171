#!/usr/bin/env bash
# Session 26, call 2: the envelope over KV computed by a prefill (--context-source ledger: each
# sequence a ledger-like token stream, greedy decode fed back) against random pages and tokens,
# Quest and Seer at 32K, batch 8 (and Quest at 16 if time is left).
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
start=$SECONDS
common=(--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2
        --decode-context 32768 --sparse-budget 512)
run() {
  local t=$1 name=$2; shift 2
  local left=$((480 - (SECONDS - start))); [ $left -lt $t ] && t=$left
  [ $t -lt 40 ] && { echo "== $name skipped (time)"; return; }
  local s=$SECONDS
  timeout $t .gpu-bin/bin/spin_bench_model "${common[@]}" "$@" > $OUT/env_$name.md 2>&1; echo "== $name exit $? in $((SECONDS - s)) s"
  grep -a '^| [0-9]\|rror\|^- batch' $OUT/env_$name.md | cut -c1-400
}
run 200 quest_b8_ledger --sparse-algorithm quest --batch 8 --context-source ledger
run 100 quest_b8_random --sparse-algorithm quest --batch 8
run 150 seer_b8_ledger --sparse-algorithm seer --batch 8 --context-source ledger
run 240 quest_b16_ledger --sparse-algorithm quest --batch 16 --context-source ledger
