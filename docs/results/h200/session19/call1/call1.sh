#!/usr/bin/env bash
# Session 19, call 1: the GPU tests (after session 18's sampling hand-off change), and every
# algorithm's envelope rows with eee0206's RMS-1 random pages and the breakdown's warm-up now run
# until each cache's worth of distinct pages was selected twice (12..400 steps).
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
timeout 200 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1
echo "gpu tests exit $?"; tail -n 4 $OUT/gpu_tests.log
rope='{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}'
common=(--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2)
b32=(--decode-context 32768 --batch 1 8)
run() { local name=$1; shift; timeout 110 .gpu-bin/bin/spin_bench_model "${common[@]}" "$@" > $OUT/env_$name.md 2>&1; echo "== $name exit $?"; grep '^| [0-9]' $OUT/env_$name.md; }
run quest_32k "${b32[@]}" --sparse-algorithm quest --sparse-budget 512
run seer_32k "${b32[@]}" --sparse-algorithm seer --sparse-budget 512
run shadowkv_32k "${b32[@]}" --sparse-algorithm shadowkv --block-size 8
run retroinfer_32k "${b32[@]}" --sparse-algorithm retroinfer
run quest16_49k --rope-scaling "$rope" --decode-context 49152 --batch 4 --sparse-algorithm quest --sparse-budget 768 --kv-buffer-factor 16
