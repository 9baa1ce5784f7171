#!/usr/bin/env bash
# Session 36, call 3 (carrying .gpu-bin with base and gemv4 = branch wip/gemv-small: wip/gemv on
# main 0646a16 with kMaxGemvRows 4, no norm/SwiGLU fusion).
# Usage: call3.sh [SECONDS the call may run, 500]. In order of need:
#   GPU tests of gemv4 (do the batch-invariance tests hold without the fused norm?);
#   dense A/B base -> gemv4 at 32K, batch 1 2 4 8 (8 runs cuBLAS in both: the noise floor),
#   Qwen3-14B then Llama-3.1-8B; Quest over ledgers base -> gemv4 at batch 1 and 4.
nvidia-smi -L
source docs/results/h200/session34/next/unpack.sh
source scripts/gpu-runs.sh ${1:-500}
T0=$SECONDS
timeout 150 .gpu-bin/gemv4/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests_gemv4.log 2>&1
echo "== gemv4 gpu tests exit $? in $((SECONDS - T0)) s"; grep -a "FAILED\|Failure" $OUT/gpu_tests_gemv4.log | head -8
tail -3 $OUT/gpu_tests_gemv4.log
ab() {  # NAME BEFORE AFTER PER_RUN_LIMIT args...
  local name=$1 before=$2 after=$3 t
  t=$(run_limit $4); shift 4
  [ "$t" -lt 30 ] && { echo "== $name skipped (time)"; return; }
  SPIN_AB_TIMEOUT=$((t / 2)) bash scripts/gpu-ab.sh .gpu-bin/$before/spin_bench_model \
    .gpu-bin/$after/spin_bench_model 1 "$@" \
    > $OUT/ab_$name.txt 2>&1
  mv $OUT/ab.md $OUT/ab_$name.md
  echo "== $name ($before -> $after) at $((SECONDS - T0)) s"; tail -6 $OUT/ab_$name.txt | cut -c1-250
}
dense="--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --decode-context 32768
       --batch 1 2 4 8"
ab dense_qwen base gemv4 160 $dense --model qwen3-14b
ab dense_llama base gemv4 130 $dense --model llama-3.1-8b
ab quest_ledger base gemv4 170 --device cuda --load-format dummy --model qwen3-14b --prefill 16 \
  --decode-context 32768 --decode-tokens 16 --repeats 2 --context-source ledger --sparse-algorithm quest \
  --sparse-budget 512 --batch 1 4
