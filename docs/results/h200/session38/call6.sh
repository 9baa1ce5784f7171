#!/usr/bin/env bash
# Session 38's sixth call: mma4 (call 5) with the last round of a row stopping at each warp's first
# step past the row's end ("mma6"): a row of 5120 (Qwen3-14B) is a full round and a quarter, and
# mma4 ran every step of the quarter. Usage: call6.sh [SECONDS, 200]. In order of need: its gemv,
# GEMM and batch-invariance tests; spin_bench_gpu_kernels products of final and mma6; dense A/Bs at
# 32K, cuBLASLt -> mma6 (--gemv-rows 8), Qwen3-14B and Llama-3.1-8B at batch 1 2 4 8.
nvidia-smi -L
source scripts/gpu-runs.sh ${1:-200}
T0=$SECONDS
timeout 60 .gpu-bin/mma6/spin_gpu_tests --gtest_brief=1 \
  --gtest_filter='*Gemv*:*Gemm*:*BatchInvariant*:*Alone*' > $OUT/gpu_tests.txt 2>&1
echo "== mma6 gpu tests exit $? in $((SECONDS - T0)) s"; grep -a "FAILED\|Failure\|expected" $OUT/gpu_tests.txt | head -12
tail -2 $OUT/gpu_tests.txt
for b in final mma6; do
  timeout $(run_limit 30) .gpu-bin/$b/spin_bench_gpu_kernels products $OUT/products_$b.csv > /dev/null 2>&1
  echo "== products $b exit $? at $((SECONDS - T0)) s"
done
python3 - $OUT <<'PY'
import csv, sys
t = {}
for b in ["final", "mma6"]:
    for r in csv.DictReader(open(f"{sys.argv[1]}/products_{b}.csv")):
        t[(b, r["config"], r["variant"])] = float(r["time_us"])
print("config, us: cuBLASLt final mma6 | cuBLASLt / mma6, final / mma6")
for (b, cfg, v), us in t.items():
    if b == "final" and v == "cublasLt":
        m, f = t.get(("mma6", cfg, "gemv.h"), 0), t.get(("final", cfg, "gemv.h"), 0)
        print(f"{cfg:28s} {us:8.2f} {f:8.2f} {m:8.2f} | {us / m:.3f} {f / m:.3f}")
PY
wrap lt final --gemv-rows 0
wrap m6 mma6 --gemv-rows 8
dense="--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --decode-context 32768"
ab qwen_m6 lt m6 40 $dense --model qwen3-14b --batch 1 2 4 8
ab llama_m6 lt m6 40 $dense --model llama-3.1-8b --batch 1 2 4 8
rm -f $OUT/ab_*.txt
