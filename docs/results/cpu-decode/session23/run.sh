#!/usr/bin/env bash
# Builds the repository's CPU block product and the same file with PATCH applied into one program
# (harness.cpp) and runs it. usage: run.sh [PATCH] (default: shuffle_unpack.patch beside this file).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../../.." && pwd)
patch=${1:-$here/shuffle_unpack.patch}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# One copy per namespace; block_bytes and block_matmul_supported stay in the first only.
sed 's/^namespace spin::cpu {/namespace base {\nusing namespace spin::cpu;/; s|^}  // namespace spin::cpu|}  // namespace base|' \
  "$repo/src/kernels/cpu/block_matmul.cpp" >"$work/base.cpp"
mkdir -p "$work/src/kernels/cpu"
cp "$repo/src/kernels/cpu/block_matmul.cpp" "$work/src/kernels/cpu/"
(cd "$work" && patch -s -p1 <"$patch")
sed 's/^namespace spin::cpu {/namespace variant {\nusing namespace spin::cpu;/; s|^}  // namespace spin::cpu|}  // namespace variant|' \
  "$work/src/kernels/cpu/block_matmul.cpp" >"$work/variant.cpp"
for f in base variant; do
  sed -i '/^bool block_matmul_supported() {/,/^}/d; /^int64_t block_bytes(BlockFormat format)/d' "$work/$f.cpp"
done
cat >"$work/shared.cpp" <<'CPP'
#include "kernels/cpu/block_matmul.h"
namespace spin::cpu {
int64_t block_bytes(BlockFormat format) { return format == BlockFormat::q4_1 ? 20 : 34; }
}
CPP
g++ -O2 -std=c++20 -fopenmp -I"$repo/src" "$here/harness.cpp" "$work/base.cpp" "$work/variant.cpp" "$work/shared.cpp" -o "$work/harness"
"$work/harness"
