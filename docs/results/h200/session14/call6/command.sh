set -u
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
timeout 120 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 --gtest_filter='GpuRetroInfer*:CudaSparse*' 2>&1 | tail -3
args="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 8 --repeats 1 --batch 4 --decode-context 32768 --sparse-algorithm retroinfer"
for b in exp bin; do
  echo "== retroinfer $b"
  timeout 100 .gpu-bin/$b/spin_bench_model $args 2>&1 | tee -a $OUT/retroinfer_first_step_$b.md | grep -E "^\| 4 \|"
done
timeout 60 /usr/local/cuda/bin/ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --kernel-name regex:"retro_(update|records|assign)" --launch-count 120 --csv .gpu-bin/bin/spin_bench_model --device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 1 --repeats 1 --batch 1 --decode-context 32768 --sparse-algorithm retroinfer > $OUT/ncu_retro.csv 2>$OUT/ncu.err
python3 - $OUT/ncu_retro.csv <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
h = rows[0]; k = h.index("Kernel Name"); v = h.index("Metric Value"); u = h.index("Metric Unit")
scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3}
t = collections.defaultdict(lambda: [0, 0.0])
for r in rows[1:]:
    name = r[k].split("(")[0].split("<")[0]; t[name][0] += 1; t[name][1] += float(r[v].replace(",", "")) * scale[r[u]]
for n, (c, us) in sorted(t.items(), key=lambda x: -x[1][1]): print(f"{n:40s} {c:6d} launches {us/c:8.1f} us each")
PY
SPIN_GPU_PREBUILT=.gpu-bin SPIN_SERVE_MODES="retroinfer" SPIN_SERVE_SCALE=1 SPIN_SERVE_OUTPUT_SCALE=1 SPIN_SERVE_PROMPTS=6 SPIN_SERVE_RATES=1 SPIN_SERVE_DEVICE_GB=24 SPIN_SERVE_MAX_LEN=131072 SPIN_SERVE_ROPE_SCALING='{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}' SPIN_SERVE_SECONDS=200 SPIN_SERVE_REQUEST_TIMEOUT=195 bash scripts/gpu-serve-bench.sh 2>&1 | grep -v "requests done" | tail -12
