#!/usr/bin/env bash
# Session 31, call 7: `spin serve --device cuda --gemm-tuning FILE` end to end, on a small dummy
# Qwen3-shaped model: the first server times its decode-sized products and writes FILE, a
# completion is served; a second server loads FILE, times nothing, and serves the same tokens.
nvidia-smi -L
source scripts/gpu-runs.sh 200
mkdir -p /tmp/m && python3 - <<'PY'
import json
json.dump({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 4096, "hidden_size": 1024,
           "intermediate_size": 3072, "num_hidden_layers": 4, "num_attention_heads": 8,
           "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
           "eos_token_id": 2}, open("/tmp/m/config.json", "w"))
PY
cat > /tmp/client.py <<'PY'
import json, sys, time, urllib.request
port = sys.argv[1]
for _ in range(300):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2); break
    except Exception:
        time.sleep(0.2)
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
    headers={"Content-Type": "application/json"},
    data=json.dumps({"prompt": [5, 6, 7, 8], "max_tokens": 16, "temperature": 0, "logprobs": 1}).encode())
c = json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]; print(json.dumps(c["logprobs"]["token_logprobs"]))
PY
for k in 1 2; do
  .gpu-bin/bin/spin serve --model /tmp/m/config.json --load-format dummy --device cuda --max-model-len 1024 \
    --gpu-memory-utilization 0.3 --gemm-tuning $OUT/tuning.json --port 801$k > $OUT/serve$k.log 2>&1 &
  pid=$!
  timeout 90 python3 /tmp/client.py 801$k > $OUT/completion$k.json 2>&1
  echo "== server $k: client exit $?"; cat $OUT/completion$k.json | cut -c1-300
  kill $pid; wait $pid; echo "== server $k exit $?"
  grep -a "GEMM tuning\|error" $OUT/serve$k.log | sed 's/^\[[^]]*\] //' | cut -c1-200
done
python3 -c "import json; d=json.load(open('$OUT/tuning.json')); print('stored shapes:', [(c['rows'], c['out'], c['in'], c['output']) for c in d['tables'][0]['choices']])"
cmp $OUT/completion1.json $OUT/completion2.json && echo "== same completion"
