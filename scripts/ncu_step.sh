#!/bin/bash
# Nsight Compute on the training step's twell_ kernels (pallas_kernels/ncu_step.py):
#   bash scripts/ncu_step.sh [spec] [k=v ...]     (device machine, repo root; report in $OUT)
set -o pipefail
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1 PYTHONPATH=.:$PYTHONPATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TAG=${NCU_TAG:-step}
# XLA's autotuner launches its own kernels: only twell_ ones are profiled, those of the second
# call (the first call's five are skipped).
ncu --clock-control none --kernel-name regex:twell_ --launch-skip 5 --launch-count 5 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis \
  python3 -m pallas_kernels.ncu_step "$@" > "$OUT/ncu_$TAG.txt" 2> "$OUT/ncu_$TAG.err"
echo "ncu exit $?"; tail -3 "$OUT/ncu_$TAG.err"
grep -E "twell_|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Stall|L2 Hit|Mem Busy|Max Bandwidth|Eligible|Issued Warp|No Eligible|Block Limit|Memory Throughput|DRAM Throughput|L1/TEX Hit" "$OUT/ncu_$TAG.txt" | head -150
