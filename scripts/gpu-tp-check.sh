#!/usr/bin/env bash
# Tensor parallelism on a machine with 2 (or more) GPUs, with binaries built elsewhere
# (scripts/gpu-prebuild.sh stages them in .gpu-bin/; the device call carries .gpu-bin and
# .gpu-deps): the tensor-parallel and NCCL GPU tests, then dummy Qwen3-32B decode at tp=1 and
# tp=2 (batch 1, 8, 32; context 1024 and 8192), tp=2 without CUDA graphs, and a short scaling table
# last (rows that do not fit one GPU's KV pool at tp=1 show '-').
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0). Results go to $OUT when set.
# SPIN_GPU_PREBUILT: the binaries' folder (default .gpu-bin); SPIN_TP_MODEL: the dummy preset
# (default qwen3-32b).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/spin-gpu-tp-out}
mkdir -p "$out"
bin=${SPIN_GPU_PREBUILT:-.gpu-bin}
model=${SPIN_TP_MODEL:-qwen3-32b}
export NCCL_NVLS_ENABLE=0
export NCCL_DEBUG=${NCCL_DEBUG:-VERSION}  # the NCCL version in the log, once per communicator

deps=/tmp/spin-deps
mkdir -p "$deps"
for f in .gpu-deps/*.deb; do [ -e "$f" ] && dpkg-deb -x "$f" "$deps"; done
export LD_LIBRARY_PATH=$deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
chmod +x "$bin"/bin/* "$bin"/tests/* 2>/dev/null || true

# libnccl: the CUDA toolkit's, else the one pip installed beside the device's PyTorch.
if [ -e /usr/local/cuda/lib64/libnccl.so.2 ]; then
  nccl_dir=/usr/local/cuda/lib64
else
  nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(os.path.dirname(nvidia.nccl.__file__), "lib"))' \
    2>/dev/null || true)
fi
if [ -n "${nccl_dir:-}" ]; then
  export LD_LIBRARY_PATH=$nccl_dir:/usr/local/cuda/lib64:$LD_LIBRARY_PATH
else
  export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$LD_LIBRARY_PATH
fi
echo "libnccl from: ${nccl_dir:-(not found in /usr/local/cuda/lib64 nor nvidia.nccl; left to the dynamic loader)}" \
  | tee "$out/nccl.txt"
ldd "$bin/tests/spin_gpu_tests" | grep -E 'nccl|not found' | tee -a "$out/nccl.txt"
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$out/gpu.txt"
nvidia-smi topo -m 2>/dev/null | head -n 6 | tee -a "$out/gpu.txt"

status=0
echo "== tensor-parallel and NCCL GPU tests"
timeout 90 "$bin/tests/spin_gpu_tests" --gtest_filter='*TensorParallel*:Nccl*' \
  --gtest_output=json:"$out/tp_tests.json" 2>&1 | tee "$out/tp_tests.log" || status=1

# Decode only (the prefill rows are skipped with a tiny --prefill); 16 timed steps x 2 repeats.
bench=("$bin/bin/spin_bench_model" --device cuda --load-format dummy --model "$model" --batch 1 8 32
       --decode-context 1024 8192 --prefill 16 --decode-tokens 16 --repeats 2)
for tp in 1 2; do
  echo "== dummy $model decode, tensor parallel $tp"
  timeout 100 "${bench[@]}" --tensor-parallel-size "$tp" 2>&1 | tee "$out/bench_tp$tp.md" || status=1
done
# The all-reduces inside CUDA graphs against eager steps (and a fallback figure if capture fails).
echo "== dummy $model decode, tensor parallel 2, CUDA graphs off"
timeout 60 "$bin/bin/spin_bench_model" --device cuda --load-format dummy --model "$model" --batch 1 8 \
  --decode-context 1024 --prefill 16 --decode-tokens 16 --repeats 2 --tensor-parallel-size 2 --no-cuda-graphs \
  2>&1 | tee "$out/bench_tp2_no_graphs.md" || status=1

echo "== decode tok/s: tensor parallel 1 vs 2 ($model, dummy weights)"
python3 - "$out/bench_tp1.md" "$out/bench_tp2.md" <<'EOF' | tee "$out/scaling.md"
import re, sys
def rates(path):
    table = {}
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return table
    for line in lines:
        cells = [c.strip() for c in line.strip().strip('|').split('|')]
        if len(cells) >= 3 and cells[0].isdigit() and cells[1].isdigit() and re.match(r'^[0-9.]+$', cells[2]):
            table[(int(cells[0]), int(cells[1]))] = float(cells[2])
    return table
one, two = rates(sys.argv[1]), rates(sys.argv[2])
print("| batch | context | tp1 tok/s | tp2 tok/s | tp2 / tp1 |")
print("|---|---|---|---|---|")
for key in sorted(set(one) | set(two)):
    a, b = one.get(key), two.get(key)
    ratio = f"{b / a:.2f}" if a and b else "-"
    print(f"| {key[0]} | {key[1]} | {a if a else '-'} | {b if b else '-'} | {ratio} |")
EOF
exit $status
