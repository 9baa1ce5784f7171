#!/usr/bin/env bash
# Session 31, call 1: the GEMM tuning file. GPU tests (GpuGemm first), then Qwen3-14B dense at
# 32K: one run that fills the tuning file (its log has each shape's timing), then A/B of the same
# binary without (before) and with (after) the file, 2 rounds.
nvidia-smi -L
source scripts/gpu-runs.sh 570
s=$SECONDS
timeout 200 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1
echo "== gpu tests exit $? in $((SECONDS - s)) s"; grep -a "GpuGemm\|FAILED" $OUT/gpu_tests.log | head; tail -3 $OUT/gpu_tests.log
export TUNING=$OUT/tuning_qwen3.json
printf '#!/usr/bin/env bash\nexec .gpu-bin/bin/spin_bench_model --gemm-tuning "$TUNING" "$@"\n' > /tmp/tuned.sh
chmod +x /tmp/tuned.sh
dense="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 32 --repeats 3
    --decode-context 32768 --batch 1 8"
s=$SECONDS
timeout 90 /tmp/tuned.sh $dense > $OUT/tune_qwen3.md 2>&1
echo "== tuning run exit $? in $((SECONDS - s)) s"; grep -a "GEMM tuning\|^| [0-9]" $OUT/tune_qwen3.md | cut -c1-250
s=$SECONDS
SPIN_AB_TIMEOUT=90 bash scripts/gpu-ab.sh .gpu-bin/bin/spin_bench_model /tmp/tuned.sh 2 $dense
mv $OUT/ab.md $OUT/ab_qwen3.md
echo "== qwen3 a/b in $((SECONDS - s)) s"
grep -a "GEMM tuning" $OUT/ab_qwen3.md | head -3
