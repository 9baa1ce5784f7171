#!/usr/bin/env bash
# Session 31, call 2: the GEMM tuning file, more evidence. Llama-3.1-8B dense at 32K: a tuning run,
# then A/B without (before) / with (after) the file, 3 rounds; Qwen3-14B the same on this machine
# (a fresh file); then ncu per-kernel tables of Qwen3-14B's batch-1 step without and with the file.
nvidia-smi -L
source scripts/gpu-runs.sh 570
printf '#!/usr/bin/env bash\nexec .gpu-bin/bin/spin_bench_model --gemm-tuning "$TUNING" "$@"\n' > /tmp/tuned.sh
chmod +x /tmp/tuned.sh
for model in llama-3.1-8b qwen3-14b; do
  export TUNING=$OUT/tuning_$model.json
  dense="--device cuda --load-format dummy --model $model --prefill 16 --decode-tokens 32 --repeats 3
      --decode-context 32768 --batch 1 8"
  s=$SECONDS
  timeout 90 /tmp/tuned.sh $dense > $OUT/tune_$model.md 2>&1
  echo "== $model tuning run exit $? in $((SECONDS - s)) s"; grep -a "GEMM tuning:" $OUT/tune_$model.md | cut -c27-250
  s=$SECONDS
  SPIN_AB_TIMEOUT=90 bash scripts/gpu-ab.sh .gpu-bin/bin/spin_bench_model /tmp/tuned.sh 3 $dense
  mv $OUT/ab.md $OUT/ab_$model.md
  echo "== $model a/b in $((SECONDS - s)) s"
done
ncu_args="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 4 --repeats 1
    --decode-context 32768 --batch 1"
ncu_bench ncu_qwen3_plain 150 4 $ncu_args
ncu_bench ncu_qwen3_tuned 150 4 $ncu_args --gemm-tuning $OUT/tuning_qwen3-14b.json
