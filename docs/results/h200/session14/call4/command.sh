set -u
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
timeout 300 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 2>&1 | tail -4
m=".gpu-bin/bin/spin_bench_model"
args="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 8 --repeats 1 --batch 4 --decode-context 32768 --sparse-algorithm retroinfer"
for r in 1; do for b in exp/spin_bench_model bin/spin_bench_model exp/spin_bench_model bin/spin_bench_model; do
  n=$(basename $b)
  echo "== retroinfer $n round $r"
  timeout 150 .gpu-bin/$b $args 2>&1 | tee -a $OUT/retroinfer_first_step_$n.md | grep -E "^\| 4 \|"
done; done
echo "== retroinfer 128K batch 1"
timeout 150 $m --device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 8 --repeats 1 --batch 1 --decode-context 131072 --sparse-algorithm retroinfer 2>&1 | tee $OUT/retroinfer_128k.md | grep -E "^\| 1 \|"
timeout 200 /usr/local/cuda/bin/ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --kernel-name regex:retro_ --launch-count 1300 --csv $m --device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 1 --repeats 1 --batch 1 --decode-context 32768 --sparse-algorithm retroinfer > $OUT/ncu_retro_transition.csv 2>$OUT/ncu.err
python3 - $OUT/ncu_retro_transition.csv <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
h = rows[0]; k = h.index("Kernel Name"); v = h.index("Metric Value"); u = h.index("Metric Unit")
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
t = collections.defaultdict(lambda: [0, 0.0])
for r in rows[1:]:
    name = r[k].split("(")[0].split("<")[0]; t[name][0] += 1; t[name][1] += float(r[v].replace(",", "")) * scale[r[u]]
for n, (c, us) in sorted(t.items(), key=lambda x: -x[1][1])[:8]: print(f"{n:40s} {c:6d} launches {us/1e3:9.2f} ms {us/c:8.1f} us each")
PY
