#!/usr/bin/env bash
# Session 40's second call, on the machine call 1 left warm (builds as call1.sh says): one more
# round of land -> c1 for Quest at batch 8 and 16 and for Seer at batch 1 and 8, and c1 -> c2 for
# Quest. Usage: call2.sh [SECONDS, 330].
nvidia-smi -L
source scripts/gpu-runs.sh ${1:-330}
q="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 16
   --repeats 2 --sparse-budget 512"
ab quest2 land c1 110 $q --sparse-algorithm quest --batch 8 16
ab seer land c1 110 $q --sparse-algorithm seer --batch 1 8
ab quest_grid2 c1 c2 90 $q --sparse-algorithm quest --batch 8 16
rm -f $OUT/ab_*.txt
