#!/usr/bin/env bash
# Session 22, call 3: a timeline of one eager split step (experimental build: events per part
# and layer at the store's forward entry, plan end, fetch start and end on the Retrieve stream, and
# forward exit), Quest at batch 16, 32K; then the same without the split, eager.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
common=(--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2 --decode-context 32768 --batch 16 --sparse-algorithm quest --sparse-budget 512 --no-cuda-graphs)
SPIN_EXP_TIMELINE=1 timeout 200 .gpu-bin/exp/spin_bench_model "${common[@]}" --split-decode-rows 16 > $OUT/quest_b16_split_eager.md 2> $OUT/timeline.txt; echo "== split exit $?"
grep -E '^\| [0-9]|^steps' $OUT/quest_b16_split_eager.md
grep "^TL" $OUT/timeline.txt | awk '$2>=2 && $2<=5'
grep "^TL" $OUT/timeline.txt | tail -4
timeout 200 .gpu-bin/exp/spin_bench_model "${common[@]}" > $OUT/quest_b16_whole_eager.md 2>&1; echo "== whole exit $?"
grep -E '^\| [0-9]|^steps' $OUT/quest_b16_whole_eager.md
