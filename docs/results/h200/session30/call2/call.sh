#!/usr/bin/env bash
# Session 30, call 2: is the fastest cuBLASLt candidate the same from one process to the next?
nvidia-smi -L
chmod +x .gpu-exp/*
for i in 1 2 3; do timeout 120 .gpu-exp/gemm_memset_survey 15 > $OUT/survey_process$i.md 2>&1; echo "process $i exit $?"; done
