#!/bin/bash
# One device call for the training kernels (issue 4): fwd+bwd benchmark, then the GPU tests.
# Usage on the device machine (repo root):  bash pallas_kernels/gpu_train_check.sh
# The tests run with XLA GEMM autotuning off (many small tail/fallback GEMM shapes to compile)
# and are interrupted with SIGINT on timeout so that pytest prints where it stood.
set -o pipefail
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
if [ "${BENCH_TIMEOUT:-240}" != 0 ]; then
  timeout ${BENCH_TIMEOUT:-240} python3 -m pallas_kernels.benchmark --mode=fwd_bwd \
    --specs=${SPECS:-paper_16k,paper_16k_heavy} --impls=dense,mosaic_gpu,twell_dense,xla \
    --out=$OUT/bench_train.json 2>&1 | tee $OUT/bench_train.log | grep -v "^  File\|^    " | tail -30
fi
XLA_FLAGS="--xla_gpu_autotune_level=0 $XLA_FLAGS" timeout -s INT ${TEST_TIMEOUT:-240} \
  python3 -m pytest -v -p no:cacheprovider --durations=10 tests/test_mgpu_train.py \
  -k "${KSEL:-Gpu}" 2>&1 | tee $OUT/tests_train.log | tail -60
