#!/usr/bin/env bash
# Two builds of spin_bench_model side by side in one device call: runs BEFORE and AFTER one after
# the other, ROUNDS times, with the same arguments, then prints bench/gpu/ab_compare.py's table
# (per decode row: each build's median tok/s and measured / ideal, and AFTER / BEFORE). Alternating
# keeps the GPU's drift over the call out of the ratio.
# usage: scripts/gpu-ab.sh BEFORE AFTER ROUNDS spin_bench_model-arguments...
#   BEFORE, AFTER: spin_bench_model binaries (e.g. one built from the parent commit and carried in
#   .gpu-bin/exp, and .gpu-bin/bin/spin_bench_model). Raw output: $OUT/ab.md when OUT is set.
# Env: SPIN_AB_TIMEOUT [150: seconds per run].
set -uo pipefail
if [ $# -lt 4 ]; then
  sed -n '2,9p' "$0"
  exit 2
fi
cd "$(dirname "$0")/.."
before=$1 after=$2 rounds=$3
shift 3
out=${OUT:-/tmp/spin-gpu-ab-out}
mkdir -p "$out"
source scripts/gpu-deps-env.sh
chmod +x "$before" "$after" 2>/dev/null || true
raw=$out/ab.md
: >"$raw"
status=0
for round in $(seq "$rounds"); do
  for build in before after; do
    bin=$before
    [ "$build" = after ] && bin=$after
    echo "=== $build round $round: $bin $*" >>"$raw"
    timeout "${SPIN_AB_TIMEOUT:-150}" "$bin" "$@" >>"$raw" 2>&1 || { echo "$build round $round failed (see $raw)"; status=1; }
  done
done
python3 bench/gpu/ab_compare.py "$raw" || status=1
exit $status
