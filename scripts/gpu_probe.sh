#!/bin/bash
# Where the forward / forward+backward time goes on the GPU:
#   1. kernel sweeps (pallas_kernels.sweep; targets from the arguments, default: all),
#   2. the forward and forward+backward benchmarks with default XLA flags (the headline ratios),
#   3. the same with XLA's command buffers off and a per-kernel CUPTI breakdown (CUPTI
#      attributes no time to kernels inside a conditional's command buffer).
#   bash scripts/gpu_probe.sh [sweep targets...]   (on the device machine, from the repo root)
set -o pipefail
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1 PYTHONPATH=.:$PYTHONPATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
F="grep -v ^\s*File\|^\s\s\s\s[a-z_]\|xla_bridge"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
timeout ${SWEEP_TIMEOUT:-240} python3 -m pallas_kernels.sweep "$@" 2>&1 | $F | tee "$OUT/sweep.log"
FWD_SPECS=${FWD_SPECS:-paper_16k,paper_16k_heavy}
for cb in default off; do
  if [ $cb = off ]; then export XLA_FLAGS="--xla_gpu_enable_command_buffer="; BD=--breakdown; else BD=; fi
  echo "=== command buffers: $cb"
  timeout 150 python3 -m pallas_kernels.benchmark --specs=$FWD_SPECS --parts=false \
    --fwd_groups= --iters=20 $BD --out="$OUT/fwd_cb_$cb.json" 2>&1 | $F | grep -v '^{' | tail -40
  timeout 150 python3 -m pallas_kernels.benchmark --mode=fwd_bwd --specs=paper_16k,paper_16k_heavy \
    --impls=dense,mosaic_gpu --parts=false --iters=20 $BD --out="$OUT/fwd_bwd_cb_$cb.json" 2>&1 | $F | grep -v '^{' | tail -70
done 2>&1 | tee "$OUT/bench.log"
