set -u
chmod +x .gpu-bin/*/* .gpu-exp/*; source scripts/gpu-deps-env.sh; export CUDA_MODULE_LOADING=EAGER
timeout 200 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 2>&1 | tee $OUT/gpu_tests.log | tail -6
B=".gpu-bin/bin/spin_bench_model --device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3"
timeout 100 $B --model llama-3.1-8b --batch 1 --decode-context 32768 --download-logits 2>&1 | tee $OUT/dense_llama_download.md | grep -A3 "host ms"
OUT=$OUT/ab_llama bash scripts/gpu-ab.sh .gpu-bin/base/spin_bench_model .gpu-bin/bin/spin_bench_model 2 --device cuda --load-format dummy --model llama-3.1-8b --prefill 16 --decode-tokens 32 --repeats 3 --batch 1 8 --decode-context 32768 2>&1 | tail -6
grep -A3 "host ms" $OUT/ab_llama/ab.md | head -20
timeout 120 .gpu-exp/prefetch_exp 15 > $OUT/gemm_survey2.md 2>&1; sed -n '/product + norm/,$p' $OUT/gemm_survey2.md
