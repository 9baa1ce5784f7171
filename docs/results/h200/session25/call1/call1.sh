#!/usr/bin/env bash
# Session 25, call 1: the host tier over a repeated pinned backing, each copy registered on its
# own (session 24: one registration of 174 GB failed with "out of memory"). Quest at batch 32 and
# 64, 32K (host tiers of 172 and 344 GB on a 125 GiB machine), then batch 8 backed and own in
# the same call: does the backing change the step?
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
free -g | head -2
start=$SECONDS
common=(--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2)
run() {
  local t=$1 name=$2; shift 2
  local left=$((575 - (SECONDS - start))); [ $left -lt $t ] && t=$left
  [ $t -lt 40 ] && { echo "== $name skipped (time)"; return; }
  local s=$SECONDS
  timeout $t .gpu-bin/bin/spin_bench_model "${common[@]}" "$@" > $OUT/env_$name.md 2>&1; echo "== $name exit $? in $((SECONDS - s)) s"
  grep '^| [0-9]\|backing\|host tier\|rror' $OUT/env_$name.md | cut -c1-400; free -g | sed -n 2p
}
q=(--sparse-algorithm quest --sparse-budget 512 --decode-context 32768)
run 200 quest_b32_backed "${q[@]}" --batch 32 --host-tier-backing 16
run 260 quest_b64_backed "${q[@]}" --batch 64 --host-tier-backing 16
run 100 quest_b8_backed "${q[@]}" --batch 8 --host-tier-backing 16
run 100 quest_b8_own "${q[@]}" --batch 8
