#!/usr/bin/env bash
# Session 28, call 1: L2 prefetch of the output projection's weights during Quest's selection.
nvidia-smi -L
source scripts/gpu-runs.sh 520
timeout 60 .gpu-bin/tests/spin_gpu_tests --gtest_brief=1 --gtest_filter="*Prefetch*:*RopeThatStores*" 2>&1 | tail -3
common="--device cuda --load-format dummy --model qwen3-14b --prefill 16 --decode-tokens 16 --repeats 2
        --decode-context 32768 --sparse-algorithm quest --sparse-budget 512 --context-source ledger"
pf() { local name=$1 mb=$2 at=$3 t=$4; shift 4; export SPIN_L2_PREFETCH_MB=$mb SPIN_L2_PREFETCH_AT=$at; bench $name $t $common "$@"; }
pf b1_pf0_a 0 1 75 --batch 1
pf b1_pf32_at1_a 32 1 75 --batch 1
pf b8_pf0 0 1 110 --batch 8
pf b8_pf32_at1 32 1 110 --batch 8
pf b1_pf32_at0 32 0 75 --batch 1
pf b1_pf0_b 0 1 75 --batch 1
pf b1_pf32_at1_b 32 1 75 --batch 1
pf b1_pf16_at1 16 1 75 --batch 1
