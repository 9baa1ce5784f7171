#!/usr/bin/env bash
# Session 26, call 5: where Quest's step goes kernel by kernel over prefilled ledgers
# (--context-source ledger, hit rate ~0.97): ncu's duration of every kernel in the timed graph
# steps (the bench's "timed decode" NVTX range), batch 8 and batch 1, 32K.
export CUDA_MODULE_LOADING=EAGER
chmod +x .gpu-bin/*/*
source scripts/gpu-deps-env.sh
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
start=$SECONDS
common=(--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 4 --repeats 1
        --decode-context 32768 --context-source ledger --sparse-algorithm quest --sparse-budget 512)
prof() {
  local t=$1 name=$2; shift 2
  local left=$((420 - (SECONDS - start))); [ $left -lt $t ] && t=$left
  [ $t -lt 40 ] && { echo "== $name skipped (time)"; return; }
  local s=$SECONDS
  timeout $t "$NCU" --clock-control none --metrics gpu__time_duration.sum --nvtx --nvtx-include "timed decode/" \
    --launch-count 4000 --print-summary per-kernel --csv .gpu-bin/bin/spin_bench_model "${common[@]}" "$@" \
    > $OUT/ncu_$name.csv 2> $OUT/ncu_$name.err
  echo "== $name exit $? in $((SECONDS - s)) s"; tail -3 $OUT/ncu_$name.err
}
prof 260 quest_b8_ledger --batch 8
prof 150 quest_b1_ledger --batch 1
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
        name = r.get('Kernel Name', '')[:70]
        try: v = float(r['Average']); n = int(r.get('Invocations', '1') or 1)
        except Exception: continue
        scale = {'nsecond': 1e-3, 'usecond': 1.0, 'msecond': 1e3}.get(r.get('Metric Unit', ''), 1.0)
        agg[name] = (n, v * scale)
    total = sum(n * us for n, us in agg.values())
    print('##', os.path.basename(path), f'total {total/1000:.2f} ms over 4 steps')
    for name, (n, us) in sorted(agg.items(), key=lambda kv: -kv[1][0] * kv[1][1]):
        print(f'{n:6d} x {us:9.2f} us = {n*us/4000:7.3f} ms/step  {name}')
PY
