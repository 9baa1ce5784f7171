#!/usr/bin/env bash
# Tensor parallelism on a machine with 2 (or more) GPUs, with binaries built elsewhere
# (scripts/gpu-prebuild.sh stages them in .gpu-bin/; the device call carries .gpu-bin and
# .gpu-deps): the tensor-parallel and NCCL GPU tests, then (when they pass) dummy Qwen3-32B decode
# at tp=1, 2 and (with 4 GPUs) 4 (batch 1, 8, 32; context 1024 and 8192), tp=2 without CUDA graphs,
# sparse (quest, 512-token budget = 1.56% of 32K) decode at the same sizes (batch 1 and 8; context
# 16K and 32K), and a short scaling table per mode last (rows that do not fit one GPU's KV pool show
# '-'). SPIN_TP_PART=tests|bench|sparse runs only the tests, the benchmarks or the sparse ones. The one-GPU tests are scripts/gpu-check.sh's.
# A step that outlives its time limit gets its threads' stacks printed (gdb or eu-stack when the
# machine has one, else each thread's kernel wait channel) before it is killed.
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
# One thread per GPU in one process needs kernels loaded eagerly (kernels/cuda/module_loading.h).
export CUDA_MODULE_LOADING=EAGER
export NCCL_DEBUG=${NCCL_DEBUG:-VERSION}  # the NCCL version in the log, once per communicator

source scripts/gpu-deps-env.sh
export PATH=$PATH:$deps/usr/bin  # eu-stack (elfutils) for the stacks of a step that hangs
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

gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
tps=(1 2)
[ "$gpus" -ge 4 ] && tps+=(4)

# limited SECONDS LOG CMD...: runs CMD with output to LOG and the terminal; past SECONDS it prints
# the stacks of every thread, then kills it (exit status 124).
limited() {
  local limit=$1 log=$2
  shift 2
  "$@" > >(tee "$log") 2>&1 &
  local pid=$! waited=0
  while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "$limit" ]; do sleep 1; waited=$((waited + 1)); done
  if kill -0 "$pid" 2>/dev/null; then
    echo "!! still running after ${limit}s: stacks of pid $pid" | tee -a "$log.stacks"
    if command -v gdb >/dev/null; then
      gdb -p "$pid" -batch -ex 'thread apply all bt 12' 2>&1 | grep -E '^(Thread|#)' | tee -a "$log.stacks"
    elif command -v eu-stack >/dev/null; then
      # Idle pool workers (five frames in pthread_cond_wait) are left out.
      eu-stack -p "$pid" 2>&1 | python3 -c '
import re, sys
for block in re.split(r"\n(?=TID )", sys.stdin.read()):
    frames = [l for l in block.splitlines() if l.startswith("#")]
    if len(frames) > 5 or "spin::" in block or "nccl" in block.lower():
        print(block)' | tee -a "$log.stacks"
    else
      for t in /proc/"$pid"/task/*; do echo "$t $(cat "$t/comm") $(cat "$t/wchan")"; done | tee -a "$log.stacks"
    fi
    kill -9 "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    return 124
  fi
  wait "$pid"
}

status=0
part=${SPIN_TP_PART:-all}
if [ "$part" = all ] || [ "$part" = tests ]; then
  echo "== tensor-parallel and NCCL GPU tests ($gpus GPUs)"
  limited 150 "$out/tp_tests.log" "$bin/tests/spin_gpu_tests" --gtest_filter='*TensorParallel*:Nccl*' \
    --gtest_output=json:"$out/tp_tests.json" || status=1
  if [ "$status" != 0 ]; then
    echo "== the tests failed: no benchmarks"
    exit 1
  fi
fi
[ "$part" = tests ] && exit 0

# Decode only (the prefill rows are skipped with a tiny --prefill); 16 timed steps x 2 repeats.
bench=("$bin/bin/spin_bench_model" --device cuda --load-format dummy --model "$model" --batch 1 8 32
       --decode-context 1024 8192 --prefill 16 --decode-tokens 16 --repeats 2)
if [ "$part" != sparse ]; then
  for tp in "${tps[@]}"; do
    echo "== dummy $model decode, tensor parallel $tp"
    limited 100 "$out/bench_tp$tp.md" "${bench[@]}" --tensor-parallel-size "$tp" || status=1
  done
fi
sparse=("$bin/bin/spin_bench_model" --device cuda --load-format dummy --model "$model" --batch 1 8
        --decode-context 16384 32768 --prefill 16 --decode-tokens 16 --repeats 2 --sparse-algorithm quest
        --sparse-budget 512)
for tp in "${tps[@]}"; do
  echo "== dummy $model sparse decode (quest), tensor parallel $tp"
  limited 150 "$out/bench_sparse_tp$tp.md" "${sparse[@]}" --tensor-parallel-size "$tp" || status=1
done
# The all-reduces inside CUDA graphs against eager steps (and a fallback figure if capture fails).
if [ "$part" != sparse ]; then
  echo "== dummy $model decode, tensor parallel 2, CUDA graphs off"
  limited 60 "$out/bench_tp2_no_graphs.md" "$bin/bin/spin_bench_model" --device cuda --load-format dummy \
    --model "$model" --batch 1 8 --decode-context 1024 --prefill 16 --decode-tokens 16 --repeats 2 \
    --tensor-parallel-size 2 --no-cuda-graphs || status=1
fi

echo "== decode tok/s by tensor-parallel size ($model, dummy weights)"
python3 - "$out"/bench_*tp*.md <<'EOF' | tee "$out/scaling.md"
import re, sys
def rates(path):
    table = {}
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return table
    for line in lines:
        cells = [c.strip() for c in line.strip().strip('|').split('|')]
        # The first table's rows: a later one (the sparse step breakdown) has the same keys.
        if len(cells) >= 3 and cells[0].isdigit() and cells[1].isdigit() and re.match(r'^[0-9.]+$', cells[2]):
            table.setdefault((int(cells[0]), int(cells[1])), float(cells[2]))
    return table
modes = {}  # mode -> tp -> (batch, context) -> tok/s
for path in sys.argv[1:]:
    m = re.search(r'bench_(sparse_)?tp(\d+)\.md$', path)
    if m:
        modes.setdefault("sparse (quest)" if m.group(1) else "dense", {})[int(m.group(2))] = rates(path)
for mode, runs in sorted(modes.items()):
    sizes = sorted(runs)
    keys = sorted(set().union(*runs.values()))
    print(f"\n{mode}\n")
    print("| batch | context | " + " | ".join(f"tp{t} tok/s" for t in sizes) + " | " +
          " | ".join(f"tp{t} / tp1" for t in sizes if t > 1) + " |")
    print("|---|---|" + "---|" * (2 * len(sizes) - 1))
    for key in keys:
        vals = [runs[t].get(key) for t in sizes]
        base = runs.get(1, {}).get(key)
        ratios = [f"{runs[t][key] / base:.2f}" if base and runs[t].get(key) else "-" for t in sizes if t > 1]
        print(f"| {key[0]} | {key[1]} | " + " | ".join(str(v) if v else "-" for v in vals) + " | " +
              " | ".join(ratios) + " |")
EOF
exit $status
