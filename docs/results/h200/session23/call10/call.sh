set -u
chmod +x .gpu-exp/*; source scripts/gpu-deps-env.sh; export CUDA_MODULE_LOADING=EAGER
A="--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --decode-context 32768"
OUT=$OUT/ab_qwen_b1 bash scripts/gpu-ab.sh .gpu-exp/spin_bench_model_graphinfo .gpu-exp/spin_bench_model_graphinfo_after 1 $A --model qwen3-14b --batch 1 2>&1 | tail -1
grep -h "^===\|host times\|\[graph\]" $OUT/ab_qwen_b1/ab.md | sed 's/: .gpu-exp.*//'
grep -h "\[gemm\]" $OUT/ab_qwen_b1/ab.md | sort | uniq
