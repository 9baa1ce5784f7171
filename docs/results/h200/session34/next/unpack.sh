#!/usr/bin/env bash
# Sourced first by the device call scripts (session34/next/callA.sh and callB.sh, session35/callA.sh,
# session36/call3.sh): unpacks the gzipped builds carried in .gpu-bin/gz/<build>/ (gzip keeps several
# builds under the 64 MiB a call carries) into .gpu-bin/<build>/, and base's into .gpu-bin/bin/
# (where scripts/gpu-runs.sh looks). Each call script's header says which builds it expects.
for f in .gpu-bin/gz/*/*.gz; do
  v=$(basename "$(dirname "$f")")
  mkdir -p .gpu-bin/$v
  gunzip -c "$f" > .gpu-bin/$v/$(basename "$f" .gz)
done
mkdir -p .gpu-bin/bin && cp .gpu-bin/base/* .gpu-bin/bin/
chmod +x .gpu-bin/*/* 2>/dev/null
