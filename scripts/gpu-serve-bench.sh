#!/usr/bin/env bash
# Serving on one GPU with binaries built elsewhere (scripts/gpu-prebuild.sh; the device call carries
# .gpu-bin and .gpu-deps): `spin serve` on dummy Qwen3-14B with its device KV pool capped, once per
# attention mode, each driven by `spin bench` with the LongBench-v2-shaped load scaled down to fit a
# 10-minute call; the comparison tables last (requests per mode and rate; the KV store and the engine step's time per mode). Sparse modes also get a pinned host tier of
# SPIN_SERVE_HOST_RATIO x the device pool (the paper's ~2.5:1 host:HBM); dense keeps all its KV on
# the device, so the cap is what limits its batch. shadowkv runs on 8-token pages (its chunk), the
# others on 16: the same bytes of pool and host tier either way.
# Env (defaults in brackets): SPIN_SERVE_MODES [dense quest; seer, shadowkv and dense-offload also
# run; dense-offload slowly: a separate call; a sparse mode may name its own buffer factor, e.g.
# quest:16, which its files and rows are labelled by (quest-x16)], SPIN_SERVE_RATES [0.4 0.8 1.6],
# SPIN_SERVE_BURSTINESS [1: Poisson arrivals; larger is more regular, which pins a small run's
# arrival rate near the one asked for], SPIN_SERVE_PROMPTS [24], SPIN_SERVE_SCALE [0.1], SPIN_SERVE_OUTPUT_SCALE [SPIN_SERVE_SCALE: outputs
# only, so full-length prompts (SCALE 1) can run with short outputs], SPIN_SERVE_DEVICE_GB [4],
# SPIN_SERVE_HOST_RATIO [2.5], SPIN_SERVE_MAX_LEN [16384], SPIN_SERVE_BUDGET [0.0156: the budget as a share of the context],
# SPIN_SERVE_MODEL [qwen3-14b], SPIN_SERVE_TOKEN_IDS [1000:100000], SPIN_SERVE_SECONDS [270: per mode],
# SPIN_SERVE_REQUEST_TIMEOUT [240: seconds per request], SPIN_SERVE_BUFFER_FACTOR [spin's default, 5:
# the `--kv-buffer-factor` of sparse modes that name none, how far elastic buffers may grow into free device memory], SPIN_SERVE_ROPE_SCALING [none: the model's;
# the whole LongBench-v2 shape (SCALE 1, prompts up to 120K) on Qwen3 needs
# '{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}' and MAX_LEN 131072],
# SPIN_SERVE_DEVICE [cuda; cpu
# makes it a smoke test of the script]. Results go to $OUT when set: serving.md (the table) and
# runs.tar.gz (each mode's JSON, logs and /metrics).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/spin-gpu-serve-out}
mkdir -p "$out"
bin=${SPIN_GPU_PREBUILT:-.gpu-bin}/bin
source scripts/gpu-deps-env.sh
chmod +x "$bin"/* 2>/dev/null || true

modes=(${SPIN_SERVE_MODES:-dense quest})
rates=(${SPIN_SERVE_RATES:-0.4 0.8 1.6})
prompts=${SPIN_SERVE_PROMPTS:-24}
scale=${SPIN_SERVE_SCALE:-0.1}
output_scale=${SPIN_SERVE_OUTPUT_SCALE:-$scale}
model=${SPIN_SERVE_MODEL:-qwen3-14b}
seconds=${SPIN_SERVE_SECONDS:-270}
budget=${SPIN_SERVE_BUDGET:-0.0156}
page_kb=8  # bf16 K+V of 16 tokens x head_dim 128: one 16-token page (one layer x KV head)
device_pages=$(python3 -c "print(int(${SPIN_SERVE_DEVICE_GB:-4} * 1e9 / ($page_kb * 1024)))")
host_pages=$(python3 -c "print(int($device_pages * ${SPIN_SERVE_HOST_RATIO:-2.5}))")
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt" 2>/dev/null || true

# GET $1: the body on stdout, false unless HTTP 200.
http_get() { python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' "$1" 2>/dev/null; }

status=0
port=18600
labels=()
for spec in "${modes[@]}"; do
  mode=${spec%%:*}
  factor=${SPIN_SERVE_BUFFER_FACTOR:-}
  [ "$spec" != "$mode" ] && factor=${spec#*:}
  label=${spec/:/-x}
  labels+=("$label")
  port=$((port + 1))
  block=16
  [ "$mode" = shadowkv ] && block=8
  flags=(--device "${SPIN_SERVE_DEVICE:-cuda}" --load-format dummy --model "$model" --port "$port" --max-model-len "${SPIN_SERVE_MAX_LEN:-16384}"
         --max-num-seqs 64 --block-size "$block" --kv-device-pages $((device_pages * 16 / block)))
  [ -n "${SPIN_SERVE_ROPE_SCALING:-}" ] && flags+=(--rope-scaling "$SPIN_SERVE_ROPE_SCALING")
  if [ "$mode" != dense ]; then
    flags+=(--kv-host-pages $((host_pages * 16 / block)) --sparse-algorithm "$mode" --sparse-budget "$budget")
    [ -n "$factor" ] && flags+=(--kv-buffer-factor "$factor")
  fi
  echo "== $label: spin serve ${flags[*]}"
  "$bin/spin" serve "${flags[@]}" >"$out/serve_$label.log" 2>&1 &
  server=$!
  for _ in $(seq 600); do
    http_get "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 "$server" 2>/dev/null || break
    sleep 0.2
  done
  if ! http_get "http://127.0.0.1:$port/health" >/dev/null; then
    echo "!! $label: the server did not start"; tail -n 20 "$out/serve_$label.log"; status=1
    kill "$server" 2>/dev/null; wait "$server" 2>/dev/null
    continue
  fi
  timeout "$seconds" "$bin/spin" bench --base-url "http://127.0.0.1:$port/v1" --dataset-name longbench-v2 \
    --length-scale "$scale" --output-length-scale "$output_scale" --num-prompts "$prompts" --request-rate "${rates[@]}" --burstiness "${SPIN_SERVE_BURSTINESS:-1}" --token-ids "${SPIN_SERVE_TOKEN_IDS:-1000:100000}" \
    --goodput ttft:10000 tpot:100 --timeout "${SPIN_SERVE_REQUEST_TIMEOUT:-240}" --json-out "$out/bench_$label.json" 2>&1 | tee "$out/bench_$label.log" \
    || { echo "!! $label: bench failed or ran out of time"; status=1; }
  http_get "http://127.0.0.1:$port/metrics" | grep -E '^spin_(kv|preempt|request|engine|model)' >"$out/metrics_$label.txt"
  kill -INT "$server" 2>/dev/null
  wait "$server" 2>/dev/null
done

echo "== $model, device KV pool $device_pages pages (${SPIN_SERVE_DEVICE_GB:-4} GB), sparse host tier $host_pages pages"
python3 - "$out" "${labels[@]}" <<'EOF' | tee "$out/serving.md"
import json, sys
out, modes = sys.argv[1], sys.argv[2:]
runs, kv = {}, {}
for m in modes:
    try:
        runs[m] = {str(r["request_rate"]): r for r in json.load(open(f"{out}/bench_{m}.json"))["runs"]}
    except (OSError, ValueError, KeyError):
        runs[m] = {}
    try:
        kv[m] = {k: float(v) for k, v in (line.split() for line in open(f"{out}/metrics_{m}.txt") if len(line.split()) == 2)}
    except (OSError, ValueError):
        kv[m] = {}
# Arrivals: the seconds from the first request sent to the last (a few Poisson arrivals can come
# much faster or slower than the rate asked for).
print("| mode | rate | arrivals (s) | done | req/s | out tok/s | TTFT mean / p99 (ms) | TPOT mean (ms) | ITL p50 / p99 (ms) | running batch mean / max |")
print("|---|---|---|---|---|---|---|---|---|---|")
for m in modes:
    for rate, r in runs[m].items():
        itl = r.get("itl_ms", {})
        print(f"| {m} | {rate} | {r.get('arrival_span_s', 0):.1f} | {r['completed']}/{r['num_prompts']} | {r['request_throughput']:.3f} | "
              f"{r['output_throughput']:.0f} | {r['ttft_ms']['mean']:.0f} / {r['ttft_ms']['p99']:.0f} | "
              f"{r['tpot_ms']['mean']:.1f} | {itl.get('p50', 0):.1f} / {itl.get('p99', 0):.0f} | "
              f"{r.get('mean_running_batch', 0):.1f} / {r.get('max_running_batch', 0):.0f} |")
# The KV store over each server's whole life (all its rates), from /metrics.
print()
# Step time: the engine thread's ms per step in each phase; of the forward, its final wait for the
# device (the rest is host work and earlier waits); graph = forwards launched as CUDA graphs.
print("| mode | engine steps | cache hit rate | MB fetched per step | preemptions | ms per step: schedule / forward (device wait) / finish | graph forwards |")
print("|---|---|---|---|---|---|---|")
for m in modes:
    k = kv[m]
    steps = k.get("spin_engine_steps_total", 0)
    lookups = k.get("spin_kv_cache_hits_total", 0) + k.get("spin_kv_cache_misses_total", 0)
    hit = f"{k.get('spin_kv_cache_hits_total', 0) / lookups:.3f}" if lookups else "–"
    fetched = f"{k.get('spin_kv_retrieve_bytes_total', 0) / steps / 1e6:.1f}" if steps and lookups else "–"
    preempted = sum(v for name, v in k.items() if name.startswith("spin_preemptions_total"))
    phase = {p: k.get(f'spin_engine_step_seconds_total{{phase="{p}"}}') for p in ("schedule", "forward", "finish")}
    wait = k.get("spin_model_device_wait_seconds_total")
    timing = "–"
    if steps and None not in phase.values():
        per = {p: 1e3 * v / steps for p, v in phase.items()}
        waited = f" ({1e3 * wait / steps:.2f})" if wait is not None else ""
        timing = f"{per['schedule']:.2f} / {per['forward']:.2f}{waited} / {per['finish']:.2f}"
    eager, graph = k.get('spin_model_forwards_total{kind="eager"}'), k.get('spin_model_forwards_total{kind="graph"}')
    graphs = f"{graph / (eager + graph):.3f}" if eager is not None and graph is not None and eager + graph else "–"
    print(f"| {m} | {steps:.0f} | {hit} | {fetched} | {preempted:.0f} | {timing} | {graphs} |")
base = runs.get("dense", {})
for m in modes:
    if m == "dense":
        continue
    for rate, r in runs[m].items():
        d = base.get(rate)
        if d and d["output_throughput"] > 0 and r["ttft_ms"]["mean"] > 0:
            print(f"{m} / dense at rate {rate}: output throughput {r['output_throughput'] / d['output_throughput']:.2f}x, "
                  f"TTFT {d['ttft_ms']['mean'] / r['ttft_ms']['mean']:.2f}x lower")
EOF
# A device call brings back at most 8 files: there (OUT set) the table stays a file of its own and
# everything else goes into one archive.
if [ -n "${OUT:-}" ]; then
  (cd "$out" && tar -czf runs.tar.gz --exclude serving.md --exclude runs.tar.gz ./* && find . -type f ! -name serving.md ! -name runs.tar.gz -delete)
fi
exit $status
