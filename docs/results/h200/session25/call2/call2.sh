#!/usr/bin/env bash
# Session 25, call 2: the host tier over a repeated backing made with CUDA's virtual memory
# management (one pinned allocation, mapped again and again; call 1's registrations of a repeated
# mmap failed past the RAM). Its gather tests, Quest at batch 8 backed and own (does the backing
# change the step?), then batch 32 and 64 at 32K (host tiers of 172 and 344 GB).
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
free -g | head -2
start=$SECONDS
timeout 60 .gpu-bin/tests/spin_gpu_tests --gtest_filter='GpuGather.*' > $OUT/gather_tests.log 2>&1; echo "== gather tests exit $?"; grep -E "OK|FAILED|rror" $OUT/gather_tests.log | head -20
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
run 60 quest_b8_backed "${q[@]}" --batch 8 --host-tier-backing 16
run 60 quest_b8_own "${q[@]}" --batch 8
run 200 quest_b32_backed "${q[@]}" --batch 32 --host-tier-backing 16
run 260 quest_b64_backed "${q[@]}" --batch 64 --host-tier-backing 16
