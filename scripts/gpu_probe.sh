#!/bin/bash
# Where the forward / forward+backward time goes on the GPU: kernel sweeps (pallas_kernels.sweep),
# then the benchmarks with a per-kernel CUPTI breakdown. XLA's command buffers are turned off
# for the breakdown runs (CUPTI attributes no time to kernels inside a conditional's command
# buffer); the headline ratios come from the default-flag runs of gpu_session.sh.
#   bash scripts/gpu_probe.sh [sweep targets...]   (on the device machine, from the repo root)
set -o pipefail
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1 PYTHONPATH=.:$PYTHONPATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
timeout ${SWEEP_TIMEOUT:-240} python3 -m pallas_kernels.sweep "$@" 2>&1 | grep -v "^  File\|^    [a-z]" | tee "$OUT/sweep.log"
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
timeout 150 python3 -m pallas_kernels.benchmark --specs=${FWD_SPECS:-paper_16k} --parts=false \
  --fwd_groups= --iters=20 --breakdown --out="$OUT/fwd.json" 2>&1 | grep -v "^  File\|^    [a-z]" | tee "$OUT/fwd.log" | tail -40
timeout 150 python3 -m pallas_kernels.benchmark --mode=fwd_bwd --specs=paper_16k --impls=dense,mosaic_gpu \
  --parts=false --iters=20 --breakdown --out="$OUT/fwd_bwd.json" 2>&1 | grep -v "^  File\|^    [a-z]" | tee "$OUT/fwd_bwd.log" | tail -60
