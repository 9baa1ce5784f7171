#!/usr/bin/env bash
# Session 25, call 7: RetroInfer's cache misses read inside the decode attention (the default)
# against Retrieve's separate gather before it, same call, batch 8 and 16 at 32K. Call 6's ncu
# profile put its attention at 310 us a layer at batch 8, about twice its misses at the link rate.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
start=$SECONDS
common=(--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2
        --decode-context 32768 --sparse-algorithm retroinfer)
run() {
  local t=$1 name=$2; shift 2
  local left=$((330 - (SECONDS - start))); [ $left -lt $t ] && t=$left
  [ $t -lt 30 ] && { echo "== $name skipped (time)"; return; }
  local s=$SECONDS
  timeout $t .gpu-bin/bin/spin_bench_model "${common[@]}" "$@" > $OUT/env_$name.md 2>&1; echo "== $name exit $? in $((SECONDS - s)) s"
  grep '^| [0-9]\|rror' $OUT/env_$name.md | cut -c1-400
}
run 90 retroinfer_b8_in_attention --batch 8
run 90 retroinfer_b8_separate --batch 8 --no-fetch-in-attention
run 100 retroinfer_b16_separate --batch 16 --no-fetch-in-attention
run 100 retroinfer_b16_in_attention --batch 16
