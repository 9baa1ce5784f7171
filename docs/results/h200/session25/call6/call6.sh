#!/usr/bin/env bash
# Session 25, call 6: where RetroInfer's decode step goes, kernel by kernel (ncu's duration of
# each kernel over 1500 launches in its steady state), at batch 8 and 32, 32K.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"; "$NCU" --version | tail -1
start=$SECONDS
common=(--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 4 --repeats 1
        --decode-context 32768 --sparse-algorithm retroinfer --gpu-memory-utilization 0.95)
prof() {
  local t=$1 name=$2 skip=$3; shift 3
  local s=$SECONDS
  timeout $t "$NCU" --clock-control none --metrics gpu__time_duration.sum --launch-skip $skip --launch-count 1500 \
    --print-summary per-kernel --csv .gpu-bin/bin/spin_bench_model "${common[@]}" "$@" > $OUT/ncu_$name.csv 2> $OUT/ncu_$name.err
  echo "== $name exit $? in $((SECONDS - s)) s"; tail -3 $OUT/ncu_$name.err
}
prof 240 retroinfer_b8 30000 --batch 8
prof 300 retroinfer_b32_512 30000 --batch 32 --sparse-budget 512 --host-tier-backing 16
python3 - "$OUT" <<'PY'
import csv, glob, io, sys, os
for path in sorted(glob.glob(os.path.join(sys.argv[1], 'ncu_*.csv'))):
    text = open(path).read()
    start = text.find('"ID"')
    if start < 0:
        print(path, 'no summary'); continue
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    agg = {}
    for r in rows:
        name = r.get('Kernel Name', '')[:60]
        try: v = float(r['Average']); n = int(r.get('Invocations', '1') or 1)
        except Exception: continue
        unit = r.get('Metric Unit', '')
        scale = {'nsecond': 1e-3, 'usecond': 1.0, 'msecond': 1e3}.get(unit, 1.0)
        agg[name] = (n, v * scale)
    print('##', os.path.basename(path))
    for name, (n, us) in sorted(agg.items(), key=lambda kv: -kv[1][0] * kv[1][1]):
        print(f'{n:6d} x {us:9.2f} us = {n*us/1000:8.2f} ms  {name}')
PY
