#!/usr/bin/env bash
# Session 36's prepared call (not run there: no device), carrying .gpu-bin with gzipped builds:
#   gemv4    = branch wip/gemv-small (main 0646a16 + decode steps of at most 4 rows on
#              kernels/cuda/gemv.h's kernel; --no-decode-gemv keeps them on cuBLASLt);
#   gemv4inv = its spin_gpu_tests with branch wip/gemv-small-invariant's test change (the sparse
#              batch-invariance tests on one product path).
# Usage: call3.sh [SECONDS the call may run, 500]. In order of need:
#   GPU tests of gemv4; the batch-invariance tests of gemv4inv;
#   dense A/B cuBLASLt -> gemv at 32K, batch 1 2 4 8 (8 runs cuBLASLt in both: the noise floor),
#   Qwen3-14B then Llama-3.1-8B, one binary (before = gemv4 --no-decode-gemv);
#   Quest over ledgers, same pair, batch 1 and 4.
nvidia-smi -L
source docs/results/h200/session34/next/unpack.sh
source scripts/gpu-runs.sh ${1:-500}
T0=$SECONDS
mkdir -p .gpu-bin/cublas
printf '#!/usr/bin/env bash\nexec %s/.gpu-bin/gemv4/spin_bench_model --no-decode-gemv "$@"\n' "$PWD" \
  > .gpu-bin/cublas/spin_bench_model
chmod +x .gpu-bin/cublas/spin_bench_model
timeout 150 .gpu-bin/gemv4/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests_gemv4.log 2>&1
echo "== gemv4 gpu tests exit $? in $((SECONDS - T0)) s"; grep -a "FAILED\|Failure" $OUT/gpu_tests_gemv4.log | head -8
tail -3 $OUT/gpu_tests_gemv4.log
timeout 60 .gpu-bin/gemv4inv/spin_gpu_tests --gtest_brief=1 \
  --gtest_filter='*BatchInvariant*:*GetTheirTokensAlone*' > $OUT/gpu_tests_gemv4inv.log 2>&1
echo "== gemv4inv batch-invariance tests exit $?"; grep -a "FAILED\|Failure" $OUT/gpu_tests_gemv4inv.log | head -8
tail -2 $OUT/gpu_tests_gemv4inv.log
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
ab dense_qwen cublas gemv4 160 $dense --model qwen3-14b
ab dense_llama cublas gemv4 130 $dense --model llama-3.1-8b
ab quest_ledger cublas gemv4 170 --device cuda --load-format dummy --model qwen3-14b --prefill 16 \
  --decode-context 32768 --decode-tokens 16 --repeats 2 --context-source ledger --sparse-algorithm quest \
  --sparse-budget 512 --batch 1 4
