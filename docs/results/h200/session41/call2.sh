#!/usr/bin/env bash
# Session 41's second call, on the H100 call 1 left warm (builds as call1.sh says): one more round
# of Quest head vs s41 (reversed order) and Llama-3.1-8B dense in both orders. Usage: call2.sh [SECONDS, 280].
# The Quest run timed out on both sides (100 s for three batches, each process making an 87 GB host
# tier in about 41 s); only batch 1 ran.
source scripts/gpu-runs.sh ${1:-280}
q="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-context 32768 --decode-tokens 16
   --repeats 2 --sparse-budget 512"
ab quest2 s41 head 100 $q --sparse-algorithm quest --batch 1 8 16
d="--device cuda --load-format dummy --prefill 16 --decode-context 32768 --decode-tokens 32 --repeats 3"
ab dense head s41 70 $d --model llama-3.1-8b --batch 1 8
ab dense2 s41 head 70 $d --model llama-3.1-8b --batch 1 8
rm -f $OUT/ab_*.txt
