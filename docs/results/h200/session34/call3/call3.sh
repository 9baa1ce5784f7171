#!/usr/bin/env bash
# Session 34, call 3 — not run (no device time left); the next session's first call. Binaries:
# .gpu-bin/bin = 854fae6 (base: spin_bench_model, spin_bench_gpu_kernels); .gpu-bin/wip = branch
# wip/retro-estimate-rows (aa2a9e1: the estimation's attended rows found by the lanes at once and
# read four at a time); .gpu-bin/tests = wip's GPU tests (with 854fae6's extended estimation test).
# All GPU tests; the new RetroInfer microbenchmark for both builds; ncu over the estimation kernel
# in it at batch 8; the ledger A/B base -> wip at batch 1 and 8 (4 on an 80 GB card).
nvidia-smi -L
source scripts/gpu-runs.sh 560
timeout 150 .gpu-bin/tests/spin_gpu_tests > $OUT/gpu_tests.log 2>&1
echo "== gpu tests exit $?"; grep -a "FAILED\|Failure" $OUT/gpu_tests.log | head -8; tail -3 $OUT/gpu_tests.log
for b in bin wip; do
  timeout 90 .gpu-bin/$b/spin_bench_gpu_kernels retro $OUT/retro_$b.csv > $OUT/retro_$b.log 2>&1
  echo "== retro $b exit $?"; grep -a "^retro\|rror" $OUT/retro_$b.log
done
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
timeout 120 "$ncu" --clock-control none --kernel-name regex:retro_estimate --launch-count 8 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  .gpu-bin/bin/spin_bench_gpu_kernels retro - B8 > $OUT/ncu_estimate_base.txt 2>&1
echo "== ncu exit $?"; grep -a "retro_estimate\|Duration\|Achieved Occupancy\|Registers Per\|Stall Long" $OUT/ncu_estimate_base.txt | head -24
big=8; [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ] && big=4
m="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 16 --repeats 2"
SPIN_AB_TIMEOUT=130 bash scripts/gpu-ab.sh .gpu-bin/bin/spin_bench_model .gpu-bin/wip/spin_bench_model 1 $m \
  --context-source ledger --sparse-algorithm retroinfer --batch 1 $big
mv $OUT/ab.md $OUT/ab_retro_ledger.md
grep -a "^=== \|^| [0-9]* | 32768 | " $OUT/ab_retro_ledger.md | cut -c1-300
