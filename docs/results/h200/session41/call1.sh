#!/usr/bin/env bash
# Session 41's first call. Builds gzipped in .gpu-bin/gz/BUILD/ (carry .gpu-bin and .gpu-deps):
# land = 3d59c4f (before session 40's kernels), head = e7e01a9, s41 = head with the decode
# attention's split policy worked out in 32 bits. Usage: call1.sh [SECONDS, 550]. In order of need:
# all GPU tests of s41; the decode attention alone, head -> s41 (spin_bench_gpu_kernels sparse);
# Quest steps head -> s41; session 40's open question, Seer at batch 8 land -> head; the select
# at 128K (step 128K, head). On an H200 also issue 5's envelope rows over prefilled ledgers.
nvidia-smi -L
source scripts/gpu-runs.sh ${1:-550}
gpu_tests s41 90
for b in head s41; do
  time_for "sparse $b" 60 || continue
  timeout "$t" .gpu-bin/$b/spin_bench_gpu_kernels sparse "$OUT/sparse_$b.csv" >/dev/null 2>&1
  echo "== sparse $b exit $?"
done
[ -s "$OUT/sparse_s41.csv" ] && awk -F, 'NR==FNR {t[$2 FS $3]=$4; next} FNR>1 && ($2 FS $3) in t {
  printf "%-28s %-26s %8.3f %8.3f %6.3f\n", $2, $3, t[$2 FS $3], $4, t[$2 FS $3] / $4}' \
  "$OUT/sparse_head.csv" "$OUT/sparse_s41.csv"
q="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 16
   --repeats 2 --sparse-budget 512"
ab quest head s41 90 $q --sparse-algorithm quest --batch 1 8
ab seer_random land head 80 $q --sparse-algorithm seer --batch 8
if time_for "step 128K" 40; then
  timeout "$t" .gpu-bin/s41/spin_bench_gpu_kernels step "$OUT/step128_s41.csv" 128K >/dev/null 2>&1
  echo "== step 128K exit $?"; grep -a select "$OUT/step128_s41.csv"
fi
mkdir -p .gpu-bin/bin && ln -sf ../s41/spin_bench_model .gpu-bin/bin/spin_bench_model
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  ledger="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 16
          --repeats 2 --context-source ledger --sparse-budget 512"
  bench quest_ledger 140 $ledger --sparse-algorithm quest --batch 1 8 16
  bench seer_ledger 140 $ledger --sparse-algorithm seer --batch 1 8 16
fi
rm -f $OUT/ab_*.txt
