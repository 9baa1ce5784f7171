#!/usr/bin/env bash
# Sets up, builds, and runs the main job: `spin serve` (OpenAI-compatible HTTP on port 8000) on
# the embedded default model, SmolLM2-135M-Instruct. Extra arguments go to `spin serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release -j "$(nproc)" --target spin
model=$(python3 scripts/default_model.py)
exec build/release/bin/spin serve --model "$model" --port "${PORT:-8000}" "$@"
