#!/usr/bin/env bash
# Sourced first by callA.sh / callB.sh: unpacks the gzipped builds carried in .gpu-bin/gz/<build>/
# (gzip keeps five builds under the 64 MiB a call carries) into .gpu-bin/<build>/, and base's
# into .gpu-bin/bin/ (where scripts/gpu-runs.sh looks). The builds, from session 34's working tree:
#   base  = main at the end of session 34
#   retro = branch wip/retro-estimate-rows (RetroInfer's estimation reads attended rows four at a time)
#   gemv  = branch wip/gemv (decode-sized products on kernels/cuda/gemv.h's kernel)
#   both  = both branches together (its spin_gpu_tests covers both changes)
for f in .gpu-bin/gz/*/*.gz; do
  v=$(basename "$(dirname "$f")")
  mkdir -p .gpu-bin/$v
  gunzip -c "$f" > .gpu-bin/$v/$(basename "$f" .gz)
done
mkdir -p .gpu-bin/bin && cp .gpu-bin/base/* .gpu-bin/bin/
chmod +x .gpu-bin/*/* 2>/dev/null
