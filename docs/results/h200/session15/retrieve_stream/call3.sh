#!/usr/bin/env bash
# Session 15, call 3: GPU tests; Retrieve on its own stream, old build (.gpu-bin/exp) against new.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
t0=$(date +%s)
timeout 200 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1; echo "tests rc $? at $(( $(date +%s) - t0 )) s"
tail -4 $OUT/gpu_tests.log
grep -E "FAILED|Failure" $OUT/gpu_tests.log | head -20
for algo in shadowkv retroinfer quest; do
  extra=""
  [ $algo = shadowkv ] && extra="--block-size 8"
  [ $algo = quest ] && extra="--sparse-budget 512"
  mkdir -p $OUT/ab_$algo
  OUT=$OUT/ab_$algo SPIN_AB_TIMEOUT=120 timeout 250 bash scripts/gpu-ab.sh .gpu-bin/exp/spin_bench_model .gpu-bin/bin/spin_bench_model 1 --device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2 --batch 1 8 --decode-context 32768 --sparse-algorithm $algo $extra 2>&1 | tail -5
  echo "$algo done at $(( $(date +%s) - t0 )) s"
done
