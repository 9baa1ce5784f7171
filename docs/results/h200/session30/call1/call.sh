#!/usr/bin/env bash
# Session 30, call 1: which decode products make cuBLASLt add memset nodes, and the memset-free chain.
nvidia-smi -L
chmod +x .gpu-exp/*
timeout 400 .gpu-exp/gemm_memset_survey 15 > $OUT/gemm_memset_survey.md 2>&1; echo "exit $?"
grep -a "^- " $OUT/gemm_memset_survey.md | head -20
awk -F'|' '$10+0 > 0 {print}' $OUT/gemm_memset_survey.md | head -30
