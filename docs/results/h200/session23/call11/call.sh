set -u
chmod +x .gpu-bin/*/*; source scripts/gpu-deps-env.sh; export CUDA_MODULE_LOADING=EAGER
A="--device cuda --load-format dummy --prefill 16 --decode-tokens 16 --repeats 3 --decode-context 32768 --model llama-3.1-8b --batch 1 8"
timeout 60 .gpu-bin/bin/spin_bench_model $A 2>&1 | tail -6
timeout 60 .gpu-bin/bin/spin_bench_model $A --download-logits 2>&1 | tail -6
