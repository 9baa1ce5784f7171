#!/usr/bin/env bash
# Session 39's last try, with under 300 s of device time left: all GPU tests of call 3's "land"
# build (the tree landed as 3d59c4f). Usage: call4.sh [SECONDS, 150].
nvidia-smi -L
source scripts/gpu-runs.sh ${1:-150}
gpu_tests land 120
