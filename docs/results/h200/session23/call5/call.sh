set -u
chmod +x .gpu-bin/*/*; source scripts/gpu-deps-env.sh; export CUDA_MODULE_LOADING=EAGER
A="--device cuda --load-format dummy --prefill 16 --decode-tokens 16 --repeats 2 --decode-context 32768"
timeout 150 .gpu-bin/bin/spin_bench_model $A --model llama-3.1-8b --batch 1 --compare-sampling 2>&1 | tee $OUT/sampling_llama.md | grep -A3 "Drawing\|host ms" | grep "^| 1"
SPIN_AB_TIMEOUT=140 OUT=$OUT/ab_quest bash scripts/gpu-ab.sh .gpu-bin/base/spin_bench_model .gpu-bin/bin/spin_bench_model 1 $A --model qwen3-14b --batch 1 --sparse-algorithm quest --sparse-budget 512 2>&1 | tail -3
