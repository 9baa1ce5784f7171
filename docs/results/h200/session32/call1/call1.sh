#!/usr/bin/env bash
# Session 32, call 1: all GPU tests at c64b726 (the review commit, not yet run on a GPU), then per
# model (Qwen3-14B, Llama-3.1-8B; dense, 32K, batch 1 and 8) a tuning run and A/B without / with
# its file, 2 rounds (session 31 call 6's script).
nvidia-smi -L
source scripts/gpu-runs.sh 560
s=$SECONDS
timeout 200 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1
echo "== gpu tests exit $? in $((SECONDS - s)) s"; grep -a "FAILED" $OUT/gpu_tests.log | head; tail -3 $OUT/gpu_tests.log
printf '#!/usr/bin/env bash\nexec .gpu-bin/bin/spin_bench_model --gemm-tuning "$TUNING" "$@"\n' > /tmp/tuned.sh
chmod +x /tmp/tuned.sh
for model in qwen3-14b llama-3.1-8b; do
  export TUNING=$OUT/tuning_$model.json
  dense="--device cuda --load-format dummy --model $model --prefill 16 --decode-tokens 32 --repeats 3
      --decode-context 32768 --batch 1 8"
  timeout 60 /tmp/tuned.sh $dense > $OUT/tune_$model.md 2>&1
  echo "== $model tuning run exit $?"; grep -a "GEMM tuning:" $OUT/tune_$model.md | sed 's/^\[[^]]*\] //'
  SPIN_AB_TIMEOUT=60 bash scripts/gpu-ab.sh .gpu-bin/bin/spin_bench_model /tmp/tuned.sh 2 $dense
  mv $OUT/ab.md $OUT/ab_$model.md
done
