#!/usr/bin/env bash
# Session 31, call 4: Llama-3.1-8B with the round-robin tuner: a tuning run, then A/B at batch 1
# and 8 without / with the file, 3 rounds.
nvidia-smi -L
source scripts/gpu-runs.sh 300
printf '#!/usr/bin/env bash\nexec .gpu-bin/bin/spin_bench_model --gemm-tuning "$TUNING" "$@"\n' > /tmp/tuned.sh
chmod +x /tmp/tuned.sh
dense="--device cuda --load-format dummy --model llama-3.1-8b --prefill 16 --decode-tokens 32 --repeats 3
    --decode-context 32768 --batch 1 8"
export TUNING=$OUT/tuning_llama.json
timeout 90 /tmp/tuned.sh $dense > $OUT/tune_llama.md 2>&1
echo "== tuning run exit $?"; grep -a "GEMM tuning:" $OUT/tune_llama.md | sed 's/^\[[^]]*\] //'
SPIN_AB_TIMEOUT=90 bash scripts/gpu-ab.sh .gpu-bin/bin/spin_bench_model /tmp/tuned.sh 3 $dense
