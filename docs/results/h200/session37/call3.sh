#!/usr/bin/env bash
# Session 37's third call: the landed build (.gpu-bin/gz/final/: kernels/cuda/gemv.h with four
# outputs a group on resident blocks, kMaxGemvRows 4, kDefaultGemvRows 2, the tight-pool tests on
# one product path). Usage: call3.sh [SECONDS, 120]: all GPU tests, then dense A/Bs at 32K from
# cuBLASLt (--gemv-rows 0) to the default, batch 1 2 3, Llama-3.1-8B then Qwen3-14B.
nvidia-smi -L
for f in .gpu-bin/gz/*/*.gz; do
  v=$(basename "$(dirname "$f")"); mkdir -p .gpu-bin/$v; gunzip -c "$f" > .gpu-bin/$v/$(basename "$f" .gz)
done
source scripts/gpu-runs.sh ${1:-120}
T0=$SECONDS
timeout 70 .gpu-bin/final/spin_gpu_tests --gtest_brief=1 > $OUT/gpu_tests.log 2>&1
echo "== gpu tests exit $? in $((SECONDS - T0)) s"; grep -a "FAILED\|Failure" $OUT/gpu_tests.log | head -8
tail -3 $OUT/gpu_tests.log
mkdir -p .gpu-bin/lt
printf '#!/usr/bin/env bash\nexec %s/.gpu-bin/final/spin_bench_model --gemv-rows 0 "$@"\n' "$PWD" \
  > .gpu-bin/lt/spin_bench_model
chmod +x .gpu-bin/lt/spin_bench_model
dense="--device cuda --load-format dummy --prefill 16 --decode-tokens 32 --repeats 3 --decode-context 32768"
for model in llama-3.1-8b qwen3-14b; do
  t=$(run_limit 40)
  [ "$t" -lt 30 ] && { echo "== $model skipped (time)"; continue; }
  SPIN_AB_TIMEOUT=$((t / 2)) bash scripts/gpu-ab.sh .gpu-bin/lt/spin_bench_model .gpu-bin/final/spin_bench_model 1 \
    $dense --model $model --batch 1 2 3 > $OUT/ab_$model.txt 2>&1
  mv $OUT/ab.md $OUT/ab_$model.md
  echo "== $model (cuBLASLt -> default) at $((SECONDS - T0)) s"; tail -3 $OUT/ab_$model.txt | cut -c1-250
done
