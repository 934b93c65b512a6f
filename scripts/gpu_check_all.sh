#!/bin/bash
# One device call: kernel sweeps, the headline benchmarks (default XLA flags) and the GPU tests.
#   bash scripts/gpu_check_all.sh      (on the device machine, from the repo root; logs in $OUT)
set -o pipefail
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1 PYTHONPATH=.:$PYTHONPATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
F="grep -v ^\s*File\|^\s\s\s\s[a-z_]\|xla_bridge"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
[ -n "$SWEEP" ] && timeout 200 python3 -m pallas_kernels.sweep $SWEEP 2>&1 | $F | tee "$OUT/sweep.log"
timeout 200 python3 -m pallas_kernels.benchmark --specs=${FWD_SPECS:-paper_16k,paper_16k_heavy,paper_16k_a60} \
  --parts=false --fwd_groups= --iters=30 --out="$OUT/fwd.json" 2>&1 | $F | grep -v '^{' | tee "$OUT/fwd.log" | tail -8
timeout 150 python3 -m pallas_kernels.benchmark --mode=fwd_bwd --specs=paper_16k,paper_16k_heavy \
  --impls=dense,mosaic_gpu --parts=false --iters=30 --out="$OUT/fwd_bwd.json" 2>&1 | $F | grep -v '^{' | tee "$OUT/fwd_bwd.log" | tail -8
[ "${TESTS:-1}" = 1 ] && XLA_FLAGS="--xla_gpu_autotune_level=0" timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider \
  tests/test_mgpu_train.py tests/test_mgpu_kernels.py -k "TrainGpuTest or MgpuKernelsGpuTest" 2>&1 | tail -6 | tee "$OUT/tests.log"
