#!/usr/bin/env bash
# Session 19, call 4: RetroInfer's envelope at batch 1 alone (calls 1 and 3 ran out of time at
# batch 8: its caches hit so often that the breakdown warms for up to 400 steps, and the Belady
# replay of batch 8's trace is long).
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
timeout 270 .gpu-bin/bin/spin_bench_model --device cuda --load-format dummy --model qwen3-14b --prefill 16 \
  --decode-tokens 16 --repeats 2 --decode-context 32768 --batch 1 --sparse-algorithm retroinfer > $OUT/env_retroinfer_32k_b1.md 2>&1
echo "retroinfer exit $?"; grep '^| [0-9]' $OUT/env_retroinfer_32k_b1.md
