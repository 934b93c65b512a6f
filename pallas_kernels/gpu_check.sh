#!/bin/bash
# One device call: benchmark first, then the GPU tests; logs and JSON under $OUT.
# Usage on the device machine (repo root):  bash pallas_kernels/gpu_check.sh [specs] [pytest -k] [bench timeout]
set -o pipefail
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
SPECS=${1:-paper_16k,paper_16k_heavy,paper_16k_a60,paper_131k}
KSEL=${2:-Gpu}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
timeout ${3:-330} python3 -m pallas_kernels.benchmark --specs=$SPECS --out=$OUT/bench.json ${BENCH_FLAGS} 2>&1 | tee $OUT/bench.log | grep -v "^  File\|^    \|xla_bridge"
if [ "$KSEL" != "none" ]; then
  timeout ${4:-200} python3 -m pytest -q -p no:cacheprovider --durations=20 tests/test_mgpu_kernels.py -k "$KSEL" 2>&1 | tee $OUT/tests.log | tail -40
fi
