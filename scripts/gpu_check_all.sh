#!/bin/bash
# One device call: kernel sweeps, the headline benchmarks (default XLA flags) and the GPU tests.
#   bash scripts/gpu_check_all.sh      (on the device machine, from the repo root; logs in $OUT)
set -o pipefail
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1 PYTHONPATH=.:$PYTHONPATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# The device tool returns at most 8 files: everything is also packed into logs.tgz at exit.
trap 'tar czf "$OUT/logs.tgz" -C "$OUT" --exclude=logs.tgz . 2>/dev/null; find "$OUT" -type f ! -name logs.tgz ! -name "*.json" -delete' EXIT
F="grep -v ^\s*File\|^\s\s\s\s[a-z_]\|xla_bridge"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
# SWEEP="gate l2 ..." runs pallas_kernels.sweep first (ptxas register counts in sweep_ptxas.txt).
if [ -n "$SWEEP" ]; then
  MOSAIC_GPU_DUMP_PTXAS=1 timeout ${SWEEP_TIMEOUT:-240} python3 -m pallas_kernels.sweep $SWEEP 2> "$OUT/sweep.err" | tee "$OUT/sweep.log"
  grep -E "Compiling entry|Used [0-9]+ registers" "$OUT/sweep.err" \
    | sed -E 's/.*entry function .([a-z_0-9]+).*/\1/; s/ptxas info *: //' | paste - - | sort | uniq -c > "$OUT/sweep_ptxas.txt"
  grep -iE "error|Traceback" "$OUT/sweep.err" | head -5
fi
[ "${BENCH:-1}" = 1 ] && timeout 200 python3 -m pallas_kernels.benchmark --specs=${FWD_SPECS:-paper_16k,paper_16k_heavy,paper_16k_a60} \
  --parts=false --fwd_groups= --iters=30 --out="$OUT/fwd.json" 2>&1 | $F | grep -v '^{' | tee "$OUT/fwd.log" | tail -8
[ "${BENCH:-1}" = 1 ] && timeout 150 python3 -m pallas_kernels.benchmark --mode=fwd_bwd --specs=paper_16k,paper_16k_heavy \
  --impls=dense,mosaic_gpu --parts=false --iters=30 --out="$OUT/fwd_bwd.json" 2>&1 | $F | grep -v '^{' | tee "$OUT/fwd_bwd.log" | tail -8
# BREAKDOWN=1: per-kernel device times of the training step (command buffers off, CUPTI).
[ -n "$BREAKDOWN" ] && XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 150 python3 -m pallas_kernels.benchmark \
  --mode=fwd_bwd --specs=paper_16k --impls=dense,mosaic_gpu --parts=false --breakdown --iters=20 \
  --out="$OUT/fwd_bwd_breakdown.json" 2>&1 | $F | grep -v '^{' > "$OUT/fwd_bwd_breakdown.log"; tail -3 "$OUT/fwd_bwd_breakdown.log"
[ -n "$BREAKDOWN" ] && XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 100 python3 -m pallas_kernels.benchmark \
  --specs=paper_16k --parts=false --fwd_groups= --breakdown --iters=20 \
  --out="$OUT/fwd_breakdown.json" 2>&1 | $F | grep -v '^{' > "$OUT/fwd_breakdown.log"; tail -3 "$OUT/fwd_breakdown.log"
[ "${TESTS:-1}" = 1 ] && XLA_FLAGS="--xla_gpu_autotune_level=0" timeout -s INT 280 python3 -m pytest -q -p no:cacheprovider \
  tests/test_mgpu_train.py tests/test_mgpu_kernels.py -k "${TESTS_K:-TrainGpuTest or MgpuKernelsGpuTest}" > "$OUT/tests_full.log" 2>&1; tail -6 "$OUT/tests_full.log"
