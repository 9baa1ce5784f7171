set -u
chmod +x .gpu-bin/*/* .gpu-exp/*; source scripts/gpu-deps-env.sh; export CUDA_MODULE_LOADING=EAGER
timeout 200 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 2>&1 | tee $OUT/gpu_tests.log | tail -3
A="--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --decode-context 32768"
for m in llama-3.1-8b qwen3-14b; do
  for b in 1 8; do
    OUT=$OUT/ab_${m}_b$b bash scripts/gpu-ab.sh .gpu-exp/spin_bench_model_timed_before .gpu-exp/spin_bench_model_timed_after 2 $A --model $m --batch $b 2>&1 | tail -1
    grep -h "^===\|host times" $OUT/ab_${m}_b$b/ab.md | sed 's/: .gpu-exp.*//'
  done
done
