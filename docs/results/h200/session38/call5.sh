#!/usr/bin/env bash
# Session 38's fifth call: the tensor-core product with its loads addressed by offsets from one
# pointer a round ("mma4"; call 4's ncu and SASS showed mma3 bound by instruction issue, 488 a
# round a warp, most of them address arithmetic), and the same with two buffers of pieces in turn
# instead of a copy between them ("mma5"). Usage: call5.sh [SECONDS, 240]. In order of need: mma4's
# gemv, GEMM and batch-invariance tests; spin_bench_gpu_kernels products of final, mma4 and mma5;
# dense A/Bs at 32K, cuBLASLt -> mma4 and mma5 (--gemv-rows 8), batch 1 4 8.
nvidia-smi -L
source scripts/gpu-runs.sh ${1:-240}
T0=$SECONDS
timeout 60 .gpu-bin/mma4/spin_gpu_tests --gtest_brief=1 \
  --gtest_filter='*Gemv*:*Gemm*:*BatchInvariant*:*Alone*' > $OUT/gpu_tests.txt 2>&1
echo "== mma4 gpu tests exit $? in $((SECONDS - T0)) s"; grep -a "FAILED\|Failure\|expected" $OUT/gpu_tests.txt | head -12
tail -2 $OUT/gpu_tests.txt
for b in final mma4 mma5; do
  timeout $(run_limit 60) .gpu-bin/$b/spin_bench_gpu_kernels products $OUT/products_$b.csv > /dev/null 2>&1
  echo "== products $b exit $? at $((SECONDS - T0)) s"
done
python3 - $OUT <<'PY'
import csv, sys
t = {}
for b in ["final", "mma4", "mma5"]:
    for r in csv.DictReader(open(f"{sys.argv[1]}/products_{b}.csv")):
        t[(b, r["config"], r["variant"])] = float(r["time_us"])
print("config, us: cuBLASLt final mma4 mma5 | cuBLASLt / mma4, / mma5")
for (b, cfg, v), us in t.items():
    if b == "final" and v == "cublasLt":
        m4, m5 = t.get(("mma4", cfg, "gemv.h"), 0), t.get(("mma5", cfg, "gemv.h"), 0)
        f = t.get(("final", cfg, "gemv.h"), 0)
        print(f"{cfg:28s} {us:8.2f} {f:8.2f} {m4:8.2f} {m5:8.2f} | {us / m4:.3f} {us / m5:.3f}")
PY
wrap lt final --gemv-rows 0
wrap m4 mma4 --gemv-rows 8
wrap m5 mma5 --gemv-rows 8
dense="--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --decode-context 32768"
ab qwen_m4 lt m4 40 $dense --model qwen3-14b --batch 1 4 8
ab qwen_m5 lt m5 40 $dense --model qwen3-14b --batch 1 4 8
ab llama_m4 lt m4 40 $dense --model llama-3.1-8b --batch 1 4 8
rm -f $OUT/ab_*.txt
