#!/usr/bin/env bash
# Session 20, call 5: echo's prompt logprobs on the GPU against the decode's logprobs of the same
# tokens (tests/python/test_serve_device.py, test_echo_scores_the_tokens_a_decode_drew).
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
python3 -c "import pytest" 2>&1 || echo "no pytest"
SPIN_BIN=$PWD/.gpu-bin/bin/spin timeout 200 python3 -m pytest -v -s -p no:cacheprovider tests/python/test_serve_device.py \
  -k "echo or cuda_device" 2>&1 | tee $OUT/echo_gpu.log | tail -15
