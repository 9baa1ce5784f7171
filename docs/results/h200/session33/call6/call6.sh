#!/usr/bin/env bash
# Session 33, call 6: Seer's Score with the tile picked by the work (one block a warp below a
# GPU's worth of warps, else four; tests pin both): the Seer GPU tests and the sparse engine's,
# then A/B against call 2's four-blocks build (v2), random pages, batch 1, one round.
nvidia-smi -L
source scripts/gpu-runs.sh 150
timeout 40 .gpu-bin/tests/spin_gpu_tests --gtest_filter='GpuSeerGate.*:CudaSparse*' > $OUT/gpu_tests.log 2>&1
echo "== gpu tests exit $?"; grep -a "FAILED\|Failure" $OUT/gpu_tests.log | head -8; tail -2 $OUT/gpu_tests.log
m="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 16 --repeats 2"
SPIN_AB_TIMEOUT=45 bash scripts/gpu-ab.sh .gpu-bin/bin/spin_bench_model.v2 .gpu-bin/bin/spin_bench_model 1 $m \
  --sparse-algorithm seer --sparse-budget 512 --batch 1
mv $OUT/ab.md $OUT/ab_seer_b1.md
grep -a "^| [0-9]* | 32768 | 14 " $OUT/ab_seer_b1.md | cut -d'|' -f2,5,6
