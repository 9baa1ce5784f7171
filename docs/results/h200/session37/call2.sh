#!/usr/bin/env bash
# Session 37's second call: why the decode-sized product kernel loses at batch 1 on Llama-3.1-8B
# (call 1: 0.969x) and wins on Qwen3-14B (1.045x). Builds in .gpu-bin/gz/ (call1.sh's layout):
#   gemv8   = call 1's (two outputs a block, a block per group of outputs);
#   gemv8w4 = the same with four outputs a block at every row count (outs_for in gemv.cu), so a
#             block of a short row (Llama's in 4096) carries twice the bytes;
#   p2 / p4 = resident blocks that each take groups of two / four outputs in turn and load their
#             next group's weights before reducing the current one (p2 with its GPU tests, and the
#             tight-pool tests on one product path).
# Usage: call2.sh [SECONDS, 330]. In order of need: dense A/Bs at 32K from cuBLASLt to p2,
# Llama-3.1-8B at batch 1 2 and Qwen3-14B at batch 1 2 4; p2's GPU tests; the same A/Bs to p4, then
# Llama's to w4; ncu per kernel and launch shape over 4 Llama batch-1 steps, cuBLASLt and p2.
nvidia-smi -L
source scripts/gpu-runs.sh ${1:-330}
T0=$SECONDS
wrap lt gemv8 --gemv-rows 0
wrap w4 gemv8w4 --gemv-rows 8
wrap gp2 p2 --gemv-rows 8
wrap gp4 p4 --gemv-rows 8
dense="--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --decode-context 32768"
ab llama_p2 lt gp2 60 $dense --model llama-3.1-8b --batch 1 2
ab qwen_p2 lt gp2 70 $dense --model qwen3-14b --batch 1 2 4
timeout 70 .gpu-bin/p2/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests_p2.log 2>&1
echo "== p2 gpu tests exit $? in $((SECONDS - T0)) s"; grep -a "FAILED\|Failure" $OUT/gpu_tests_p2.log | head -8
tail -3 $OUT/gpu_tests_p2.log
ab llama_p4 lt gp4 60 $dense --model llama-3.1-8b --batch 1 2
ab qwen_p4 lt gp4 70 $dense --model qwen3-14b --batch 1 2 4
ab llama_w4 lt w4 60 $dense --model llama-3.1-8b --batch 1 2
ncu_one() {  # NAME BUILD
  local t
  t=$(run_limit 80)
  [ "$t" -lt 30 ] && { echo "== ncu $1 skipped (time)"; return; }
  timeout "$t" "$(command -v ncu || echo /usr/local/cuda/bin/ncu)" --clock-control none \
    --metrics gpu__time_duration.sum --nvtx \
    --nvtx-include "timed decode/" --launch-count 4000 --print-summary per-kernel --csv \
    .gpu-bin/$2/spin_bench_model --device cuda --load-format dummy --prefill 16 --decode-tokens 4 --repeats 1 \
    --decode-context 32768 --batch 1 --model llama-3.1-8b > $OUT/ncu_$1.csv 2> $OUT/ncu_$1.err
  echo "== ncu $1 exit $? at $((SECONDS - T0)) s"
  python3 bench/gpu/ncu_summary.py --steps 4 $OUT/ncu_$1.csv | head -14
}
ncu_one llama_lt lt
ncu_one llama_p2 gp2
