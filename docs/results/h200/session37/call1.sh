#!/usr/bin/env bash
# Session 37's first call, carrying .gpu-bin/gz/ (gzipped builds of main 72b9f4d plus the uncommitted
# decode-sized product patch; session34/next/unpack.sh's layout):
#   gemv8  = kernels/cuda/gemv.h's instances for 1..8 rows, two outputs a block; spin_bench_model
#            --gemv-rows N sends the products of at most N rows to it, 0 none (all on cuBLASLt);
#   gemv8o = the same with four outputs a block from 3 rows on (outs_for in gemv.cu).
# Usage: call1.sh [SECONDS the call may run, 500]. In order of need:
#   GPU tests of gemv8 (all) and gemv8o (the gemv and GEMM ones);
#   dense at 32K, one binary: cuBLASLt (--gemv-rows 0) -> gemv (--gemv-rows 8), batch 1 2 3 4 6 8,
#   Qwen3-14B; then two against four outputs a block at batch 3 4 6 8; then Llama-3.1-8B as the first.
nvidia-smi -L
for f in .gpu-bin/gz/*/*.gz; do
  v=$(basename "$(dirname "$f")"); mkdir -p .gpu-bin/$v; gunzip -c "$f" > .gpu-bin/$v/$(basename "$f" .gz)
done
source scripts/gpu-runs.sh ${1:-500}
T0=$SECONDS
wrap() {  # NAME BUILD ARGS...: .gpu-bin/NAME/spin_bench_model runs BUILD's with ARGS first
  local name=$1 build=$2
  shift 2
  mkdir -p .gpu-bin/$name
  printf '#!/usr/bin/env bash\nexec %s/.gpu-bin/%s/spin_bench_model %s "$@"\n' "$PWD" "$build" "$*" \
    > .gpu-bin/$name/spin_bench_model
  chmod +x .gpu-bin/$name/spin_bench_model
}
wrap lt gemv8 --gemv-rows 0
wrap g8 gemv8 --gemv-rows 8
wrap o8 gemv8o --gemv-rows 8
timeout 150 .gpu-bin/gemv8/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests_gemv8.log 2>&1
echo "== gemv8 gpu tests exit $? in $((SECONDS - T0)) s"; grep -a "FAILED\|Failure" $OUT/gpu_tests_gemv8.log | head -8
tail -3 $OUT/gpu_tests_gemv8.log
timeout 40 .gpu-bin/gemv8o/spin_gpu_tests --gtest_brief=1 --gtest_filter='*Gemv*:*Gemm*' \
  > $OUT/gpu_tests_gemv8o.log 2>&1
echo "== gemv8o gemv/GEMM tests exit $?"; grep -a "FAILED\|Failure" $OUT/gpu_tests_gemv8o.log | head -8
tail -2 $OUT/gpu_tests_gemv8o.log
ab() {  # NAME BEFORE AFTER PER_RUN_LIMIT args...
  local name=$1 before=$2 after=$3 t
  t=$(run_limit $4); shift 4
  [ "$t" -lt 30 ] && { echo "== $name skipped (time)"; return; }
  SPIN_AB_TIMEOUT=$((t / 2)) bash scripts/gpu-ab.sh .gpu-bin/$before/spin_bench_model \
    .gpu-bin/$after/spin_bench_model 1 "$@" \
    > $OUT/ab_$name.txt 2>&1
  mv $OUT/ab.md $OUT/ab_$name.md
  echo "== $name ($before -> $after) at $((SECONDS - T0)) s"; tail -7 $OUT/ab_$name.txt | cut -c1-250
}
dense="--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --decode-context 32768"
ab dense_qwen lt g8 150 $dense --model qwen3-14b --batch 1 2 3 4 6 8
ab dense_qwen_outs g8 o8 120 $dense --model qwen3-14b --batch 3 4 6 8
ab dense_llama lt g8 130 $dense --model llama-3.1-8b --batch 1 2 3 4 6 8
