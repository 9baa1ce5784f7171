#!/usr/bin/env bash
# Session 21, call 5: the GPU tests with only the wanted logit rows downloaded (the Engine's
# logit_rows), the served GPU model's logprobs and echo tests, and the step with every row's
# logits downloaded against the one row a lone logprobs request needs; then whether one half-batch's
# fetch-bound attention overlaps the other half's weight products (spin_bench_gpu_kernels overlap).
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
timeout 200 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1; echo "== tests exit $?"; grep -E "FAILED|PASSED|SKIPPED \]" $OUT/gpu_tests.log | head
SPIN_BIN=$PWD/.gpu-bin/bin/spin timeout 200 python3 -m pytest -q -p no:cacheprovider tests/python/test_serve_device.py \
  -k "cuda_device or echo" > $OUT/serve_device.log 2>&1; echo "== serve tests exit $?"; tail -3 $OUT/serve_device.log
timeout 200 .gpu-bin/bin/spin_bench_model --device cuda --load-format dummy --model qwen3-14b --prefill 16 \
  --decode-tokens 16 --repeats 2 --batch 1 8 32 --decode-context 1024 --compare-sampling > $OUT/sampling_1k.md 2>&1
echo "== sampling exit $?"; sed -n '/Drawing/,$p' $OUT/sampling_1k.md | head -12
timeout 120 .gpu-bin/bin/spin_bench_gpu_kernels overlap $OUT/overlap.csv > $OUT/overlap.log 2>&1; echo "== overlap exit $?"; cat $OUT/overlap.log | tail -12
