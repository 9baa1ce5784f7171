#!/usr/bin/env bash
# Session 31, call 3: the tuner now times its candidates round-robin (call 2's ncu table showed the
# heuristic's gate_up pick as fast as the chosen one, in isolation). GpuGemm tests; two tuning
# processes of Qwen3-14B (batch 1 and 8) into two files (is the choice the same?); ncu per-kernel
# tables at batch 1 without / with the first file; A/B at batch 1 and 8, 3 rounds.
nvidia-smi -L
source scripts/gpu-runs.sh 570
timeout 100 .gpu-bin/tests/spin_gpu_tests --gtest_filter='GpuGemm*' --gtest_brief=1 2>&1 | tail -3
printf '#!/usr/bin/env bash\nexec .gpu-bin/bin/spin_bench_model --gemm-tuning "$TUNING" "$@"\n' > /tmp/tuned.sh
chmod +x /tmp/tuned.sh
dense="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 32 --repeats 3
    --decode-context 32768 --batch 1 8"
for k in 1 2; do
  export TUNING=$OUT/tuning_$k.json
  echo "=== tuning process $k" >> $OUT/tune.md
  timeout 90 /tmp/tuned.sh $dense >> $OUT/tune.md 2>&1
  echo "== tuning process $k exit $?"
done
grep -a "GEMM tuning:\|===" $OUT/tune.md | sed 's/^\[[^]]*\] //'
for b in 1; do
  ncu_args="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 4 --repeats 1
      --decode-context 32768 --batch $b"
  ncu_bench ncu_b${b}_plain 150 4 $ncu_args
  ncu_bench ncu_b${b}_tuned 150 4 $ncu_args --gemm-tuning $OUT/tuning_1.json
done
for f in $OUT/*.err; do [ -s "$f" ] && tail -3 "$f"; done; rm -f $OUT/*.err
export TUNING=$OUT/tuning_1.json
SPIN_AB_TIMEOUT=90 bash scripts/gpu-ab.sh .gpu-bin/bin/spin_bench_model /tmp/tuned.sh 3 $dense
