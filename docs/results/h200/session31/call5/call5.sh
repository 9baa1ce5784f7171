#!/usr/bin/env bash
# Session 31, call 5: why Llama-3.1-8B's batch-1 step gained nothing (call 4): a tuning run, then
# ncu per-kernel tables of its batch-1 step without / with the file, and one more A/B round.
nvidia-smi -L
source scripts/gpu-runs.sh 300
args="--device cuda --load-format dummy --model llama-3.1-8b --prefill 16 --decode-tokens 4 --repeats 1
    --decode-context 32768 --batch 1"
timeout 60 .gpu-bin/bin/spin_bench_model $args --gemm-tuning $OUT/tuning_llama.json > $OUT/tune_llama.md 2>&1
echo "== tuning run exit $?"; grep -a "GEMM tuning:" $OUT/tune_llama.md | sed 's/^\[[^]]*\] //'
ncu_bench ncu_llama_plain 100 4 $args
ncu_bench ncu_llama_tuned 100 4 $args --gemm-tuning $OUT/tuning_llama.json
for f in $OUT/*.err; do [ -s "$f" ] && tail -3 "$f"; done; rm -f $OUT/*.err
