set -u
chmod +x .gpu-exp/*; source scripts/gpu-deps-env.sh; export CUDA_MODULE_LOADING=EAGER
A="--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --decode-context 32768 --batch 1"
for m in llama-3.1-8b qwen3-14b; do
  echo "== $m"
  timeout 100 .gpu-exp/spin_bench_model_graphinfo $A --model $m 2>&1 | grep -E "^\| 1 \| 32768|host times|\[graph\]"
done
