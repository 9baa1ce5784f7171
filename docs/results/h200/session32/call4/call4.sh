#!/usr/bin/env bash
# Session 32, call 4 (second run): why Quest's score kernel reads 2.0 TB/s at batch 8 on an H100 whether its
# loads go to registers or through shared memory (call 3). ncu's memory, occupancy and warp-stall
# sections on two launches of it (HEAD c64b726), random pages, batch 8 / 32K, 60% of the GPU memory
# (call 4 first ran at the default, and ncu could not back the memory up for its replays; 0.5 did
# not fit batch 8).
nvidia-smi -L
source scripts/gpu-runs.sh 300
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
timeout 240 $ncu --clock-control none --kernel-name regex:quest_score --launch-skip 40 --launch-count 2 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
  --section LaunchStats --section SchedulerStats \
  .gpu-bin/bin/spin_bench_model --device cuda --load-format dummy --model qwen3-14b --prefill 16 \
  --decode-context 32768 --sparse-algorithm quest --sparse-budget 512 --batch 8 --decode-tokens 4 --repeats 1 --gpu-memory-utilization 0.6 \
  > $OUT/ncu_score_sections.txt 2>&1
echo "== ncu exit $?"
grep -a -v "^==PROF==\|^\[" $OUT/ncu_score_sections.txt | grep -a "Duration\|Throughput\|DRAM\|L2 Hit\|L1/TEX Hit\|Occupancy\|Registers\|Block Limit\|Warp Cycles\|Stall\|Eligible\|Issued\|Grid Size\|Waves\|Mem Busy\|Max Bandwidth\|Shared Memory" | head -60
