#!/usr/bin/env bash
# Session 35, call B: over prefilled ledgers at 32K, RetroInfer base -> retro at batch 1 and 8
# (4 on an 80 GB card); Quest base -> normgemv at batch 1 and 8; ncu over the estimation kernel in
# RetroInfer's microbenchmark at batch 8 if time is left.
nvidia-smi -L
source docs/results/h200/session34/next/unpack.sh
source scripts/gpu-runs.sh 575
big=8; [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ] && big=4
m="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 16 --repeats 2
   --context-source ledger"
SPIN_AB_TIMEOUT=$(run_limit 130) bash scripts/gpu-ab.sh .gpu-bin/base/spin_bench_model .gpu-bin/retro/spin_bench_model 1 $m \
  --sparse-algorithm retroinfer --batch 1 $big > $OUT/ab_retro_ledger.txt 2>&1
mv $OUT/ab.md $OUT/ab_retro_ledger.md
echo "== retro"; tail -4 $OUT/ab_retro_ledger.txt | cut -c1-250
SPIN_AB_TIMEOUT=$(run_limit 100) bash scripts/gpu-ab.sh .gpu-bin/base/spin_bench_model .gpu-bin/normgemv/spin_bench_model 1 $m \
  --sparse-algorithm quest --sparse-budget 512 --batch 1 8 > $OUT/ab_quest_ledger.txt 2>&1
mv $OUT/ab.md $OUT/ab_quest_ledger.md
echo "== quest"; tail -4 $OUT/ab_quest_ledger.txt | cut -c1-250
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
t=$(run_limit 120)
[ "$t" -ge 40 ] && timeout $t "$ncu" --clock-control none --kernel-name regex:retro_estimate --launch-count 8 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  .gpu-bin/base/spin_bench_gpu_kernels retro - B8 > $OUT/ncu_estimate_base.txt 2>&1
echo "== ncu exit $?"; grep -a "retro_estimate\|Duration\|Achieved Occupancy\|Registers Per" $OUT/ncu_estimate_base.txt | head -24
