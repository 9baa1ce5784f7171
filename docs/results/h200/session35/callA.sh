#!/usr/bin/env bash
# Session 35, call A (carrying .gpu-bin with session 34's gzipped builds plus normgemv = branch
# wip/norm-gemv: wip/gemv with RMSNorm fused into the product after it and SwiGLU into the gate|up
# product). Usage: callA.sh [SECONDS the call may run, 580]. In order of need, each run cut to
# what the call has left:
#   GPU tests of normgemv, and the RetroInfer tests of `both` (which has wip/retro-estimate-rows);
#   dense A/B base -> normgemv at 32K, Qwen3-14B then Llama-3.1-8B, batch 1 and 8;
#   Quest over prefilled ledgers at 32K, base -> normgemv, batch 1 and 8;
#   dense A/B gemv -> normgemv (what the fusions add), Qwen3-14B.
nvidia-smi -L
source docs/results/h200/session34/next/unpack.sh
source scripts/gpu-runs.sh ${1:-580}  # the call's seconds
T0=$SECONDS
timeout 150 .gpu-bin/normgemv/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests_normgemv.log 2>&1
echo "== normgemv gpu tests exit $? in $((SECONDS - T0)) s"; grep -a "FAILED\|Failure" $OUT/gpu_tests_normgemv.log | head -8; tail -3 $OUT/gpu_tests_normgemv.log
timeout 60 .gpu-bin/both/spin_gpu_tests --gtest_brief=1 --gtest_filter='*Retro*' > $OUT/gpu_tests_retro.log 2>&1
echo "== retro gpu tests exit $?"; grep -a "FAILED\|Failure" $OUT/gpu_tests_retro.log | head -8; tail -2 $OUT/gpu_tests_retro.log
ab() {  # NAME BEFORE AFTER PER_RUN_LIMIT args...
  local name=$1 before=$2 after=$3 t
  t=$(run_limit $4); shift 4
  [ "$t" -lt 30 ] && { echo "== $name skipped (time)"; return; }
  SPIN_AB_TIMEOUT=$((t / 2)) bash scripts/gpu-ab.sh .gpu-bin/$before/spin_bench_model .gpu-bin/$after/spin_bench_model 1 "$@" \
    > $OUT/ab_$name.txt 2>&1
  mv $OUT/ab.md $OUT/ab_$name.md
  echo "== $name ($before -> $after) at $((SECONDS - T0)) s"; tail -4 $OUT/ab_$name.txt | cut -c1-250
}
dense="--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --decode-context 32768 --batch 1 8"
ab dense_qwen base normgemv 150 $dense --model qwen3-14b
ab dense_llama base normgemv 120 $dense --model llama-3.1-8b
ab quest_ledger base normgemv 200 --device cuda --load-format dummy --model qwen3-14b --prefill 16 \
  --decode-context 32768 --decode-tokens 16 --repeats 2 --context-source ledger --sparse-algorithm quest \
  --sparse-budget 512 --batch 1 8
ab dense_qwen_fusions gemv normgemv 150 $dense --model qwen3-14b
