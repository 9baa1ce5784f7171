#!/usr/bin/env bash
# Session 19, call 5: the GPU tests on the session's final engine (penalties and logit bias hand a
# request's logits to the host Sampler; several prompts per completion), built at 60067d4's tree.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
timeout 200 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1
echo "gpu tests exit $?"; tail -n 4 $OUT/gpu_tests.log
