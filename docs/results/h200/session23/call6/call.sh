set -u
chmod +x .gpu-exp/*; source scripts/gpu-deps-env.sh; export CUDA_MODULE_LOADING=EAGER
A="--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --decode-context 32768"
for args in "--model llama-3.1-8b --batch 1" "--model llama-3.1-8b --batch 8" "--model qwen3-14b --batch 1" "--model qwen3-14b --batch 8"; do
  echo "== $args"
  timeout 100 .gpu-exp/spin_bench_model_timed $A $args 2>&1 | grep -E "^\| [0-9]+ \| 32768|host times"
done
echo "== quest"
timeout 150 .gpu-exp/spin_bench_model_timed --device cuda --load-format dummy --prefill 16 --decode-tokens 16 --repeats 2 --decode-context 32768 --model qwen3-14b --batch 1 --sparse-algorithm quest --sparse-budget 512 2>&1 | grep -E "^\| 1 \| 32768|host times"
