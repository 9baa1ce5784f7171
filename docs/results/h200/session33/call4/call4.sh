#!/usr/bin/env bash
# Session 33, call 4 (the same warm H200): the GEMM tuning file on the H200 for the dense batch-1
# goal. Qwen3-14B then Llama-3.1-8B (dense, 32K, batch 1): a tuning run, then A/B without / with
# its file, 2 rounds (session 31 call 6's script, batch 1 only).
nvidia-smi -L
source scripts/gpu-runs.sh 330
printf '#!/usr/bin/env bash\nexec .gpu-bin/bin/spin_bench_model --gemm-tuning "$TUNING" "$@"\n' > /tmp/tuned.sh
chmod +x /tmp/tuned.sh
for model in qwen3-14b llama-3.1-8b; do
  export TUNING=$OUT/tuning_$model.json
  dense="--device cuda --load-format dummy --model $model --prefill 16 --decode-tokens 32 --repeats 3
      --decode-context 32768 --batch 1"
  timeout 45 /tmp/tuned.sh $dense > $OUT/tune_$model.md 2>&1
  echo "== $model tuning run exit $?"
  SPIN_AB_TIMEOUT=40 bash scripts/gpu-ab.sh .gpu-bin/bin/spin_bench_model /tmp/tuned.sh 2 $dense
  mv $OUT/ab.md $OUT/ab_$model.md
done
