#!/usr/bin/env bash
# Downloads (here, where apt works) the Debian packages spin builds against, into .gpu-deps/,
# for scripts/gpu-check.sh to unpack on the GPU machine, which has no package registry.
# Pass `.gpu-deps` in the device call's `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu-deps
cd .gpu-deps
apt-get download -q libfmt-dev libfmt9 libspdlog-dev libspdlog1.10 nlohmann-json3-dev libcli11-dev \
  libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3 \
  libopenblas-openmp-dev libopenblas0-openmp libgfortran5 libgtest-dev libgmock-dev \
  libbenchmark-dev libbenchmark1debian \
  libcpp-httplib-dev libcpp-httplib0.11 libssl-dev libssl3 zlib1g-dev libbrotli-dev libbrotli1 \
  elfutils libasm1 libdw1 libelf1 2>&1 | grep -v '^W: Download is performed unsandboxed' || true
ls
