set -u
chmod +x .gpu-bin/*/*; source scripts/gpu-deps-env.sh; export CUDA_MODULE_LOADING=EAGER
timeout 200 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 2>&1 | tee $OUT/gpu_tests.log | tail -4
A="--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --decode-context 32768"
OUT=$OUT/ab_llama bash scripts/gpu-ab.sh .gpu-bin/base/spin_bench_model .gpu-bin/bin/spin_bench_model 2 $A --model llama-3.1-8b --batch 1 8 2>&1 | tail -4
OUT=$OUT/ab_qwen bash scripts/gpu-ab.sh .gpu-bin/base/spin_bench_model .gpu-bin/bin/spin_bench_model 2 $A --model qwen3-14b --batch 1 2>&1 | tail -3
OUT=$OUT/ab_llama_download bash scripts/gpu-ab.sh .gpu-bin/base/spin_bench_model .gpu-bin/bin/spin_bench_model 1 $A --model llama-3.1-8b --batch 1 --download-logits 2>&1 | tail -3
grep -h -A3 "host ms" $OUT/ab_llama/ab.md | grep "^| 1 "
