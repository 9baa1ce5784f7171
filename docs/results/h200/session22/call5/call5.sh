#!/usr/bin/env bash
# Session 22, call 5 (session 21's call 8): Retrieve's separate fetch (ShadowKV's, beside its key rebuild) on a bounded
# grid of about 32 blocks whatever the batch: the page-cache and sparse GPU tests, then ShadowKV at
# batch 16, 32K, with the fetch over one block per item (base, eff6d68's tree) and bounded (new).
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
timeout 40 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 --gtest_filter='GpuPageCache*' > $OUT/gpu_tests.log 2>&1; echo "== tests exit $?"; grep -E "FAILED|PASSED|SKIPPED \]" $OUT/gpu_tests.log | head
args=(--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 8 --repeats 2 --decode-context 32768 --batch 16 --sparse-algorithm shadowkv --block-size 8)
for b in new base; do
  bin=.gpu-bin/bin/spin_bench_model; [ $b = base ] && bin=.gpu-bin/base/spin_bench_model
  timeout 110 $bin "${args[@]}" > $OUT/shadowkv_b16_$b.md 2>&1; echo "== $b exit $?"; grep '^| [0-9]' $OUT/shadowkv_b16_$b.md
done
