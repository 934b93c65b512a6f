#!/bin/bash
# Kernel-variant sweeps on the GPU (x placement, split kernels): kernel times, same-bits checks,
# whole forward and forward + backward per variant vs XLA dense, and ptxas register counts.
#   WHAT="down bwd" bash scripts/gpu_variants.sh      (writes under $OUT, default /tmp/out)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/device.txt"
for w in ${WHAT:-down bwd}; do
  MOSAIC_GPU_DUMP_PTXAS=1 timeout ${PART_TIMEOUT:-270} python3 -m pallas_kernels.sweep "$w" \
    > "$OUT/sweep_$w.log" 2> "$OUT/sweep_${w}_ptxas.log"
  echo "== $w rc=$?"
  cat "$OUT/sweep_$w.log"
  grep -E "Compiling entry|Used [0-9]+ registers" "$OUT/sweep_${w}_ptxas.log" \
    | sed -E 's/.*entry function .([a-z_0-9]+).*/\1/; s/ptxas info *: //' | paste - - | sort | uniq -c
  grep -iE "error|Traceback" "$OUT/sweep_${w}_ptxas.log" | head -5
done
