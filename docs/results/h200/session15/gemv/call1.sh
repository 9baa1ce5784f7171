#!/usr/bin/env bash
# Session 15, call 1: GPU tests, the decode-batch products against cuBLASLt, model A/B.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout 200 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"
tail -5 $OUT/gpu_tests.log
grep -E "FAILED|Failure" $OUT/gpu_tests.log | head -20
timeout 150 .gpu-bin/bin/spin_bench_gpu_kernels gemv $OUT/gemv.csv > $OUT/gemv.log 2>&1; echo "gemv rc $?"
python3 - <<'PY'
import csv, os, collections
rows = list(csv.DictReader(open(os.environ["OUT"] + "/gemv.csv")))
by = collections.OrderedDict()
for r in rows: by.setdefault(r["config"], {})[r["variant"].split(" of")[0]] = float(r["time_us"])
print("| product | spin us | cuBLASLt first us | cuBLASLt best us | spin TB/s | first/spin | best/spin |")
for c, v in by.items():
    b = [r for r in rows if r["config"] == c][0]
    tb = float(b["bytes"]) / v["spin"] / 1e6
    print(f"| {c} | {v['spin']:.1f} | {v['cublaslt first']:.1f} | {v['cublaslt best']:.1f} | {tb:.2f} | {v['cublaslt first']/v['spin']:.2f} | {v['cublaslt best']/v['spin']:.2f} |")
PY
mkdir -p $OUT/ab_llama $OUT/ab_qwen
OUT=$OUT/ab_llama SPIN_AB_TIMEOUT=100 timeout 260 bash scripts/gpu-ab.sh .gpu-bin/exp/spin_bench_model .gpu-bin/bin/spin_bench_model 2 --device cuda --load-format dummy --model llama-3.1-8b --prefill 16 --decode-tokens 32 --repeats 3 --batch 1 8 --decode-context 32768 2>&1 | tail -12
OUT=$OUT/ab_qwen SPIN_AB_TIMEOUT=100 timeout 260 bash scripts/gpu-ab.sh .gpu-bin/exp/spin_bench_model .gpu-bin/bin/spin_bench_model 2 --device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 32 --repeats 3 --batch 1 8 --decode-context 32768 2>&1 | tail -12
