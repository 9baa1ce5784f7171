#!/usr/bin/env bash
# Sets up, builds, and runs the main job on the embedded default model (SmolLM2-135M-Instruct).
# Extra arguments go to `spin generate` (e.g. --prompt "..." -n 64).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release -j "$(nproc)" --target spin
model=$(python3 scripts/default_model.py)
if [ $# -eq 0 ]; then
  set -- --chat --prompt "Explain in two sentences why long-context decoding is memory-bound." -n 96
fi
exec build/release/bin/spin generate --model "$model" "$@"
