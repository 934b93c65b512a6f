#!/bin/bash
# One device call: GPU tests + benchmark, logs and JSON under $OUT (continues past failures).
# Usage on the device machine (repo root):  bash pallas_kernels/gpu_check.sh [specs] [pytest -k]
set -o pipefail
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
SPECS=${1:-small,paper_16k,paper_16k_heavy,paper_16k_a60,paper_131k}
KSEL=${2:-Gpu}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
if [ "$KSEL" != "none" ]; then
  timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_mgpu_kernels.py -k "$KSEL" 2>&1 | tee $OUT/tests.log | tail -40
fi
timeout 370 python3 -m pallas_kernels.benchmark --specs=$SPECS --out=$OUT/bench.json 2>&1 | tee $OUT/bench.log | grep -v "^  File\|^    " | tail -60
