#!/bin/bash
# One device call that refreshes the numbers quoted in the issues' closing notes, in priority order:
#   1. forward + backward benchmark against XLA dense (issue 4),
#   2. `small` LM training, sparse (mosaic_gpu) vs dense baseline: tokens/s and sparsity (issue 5),
#   3. with FWD=1, inference forward benchmark at ~60 active and 131072 tokens (issue 3),
#   4. the training-kernel GPU tests.
# Run on the device machine from the repo root with the ml_collections wheel carried in .whl:
#   bash scripts/gpu_session.sh     (logs and JSON land in $OUT)
set -o pipefail
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.:$PYTHONPATH
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee "$OUT/gpu.txt"

timeout 120 python3 -m pallas_kernels.benchmark --mode=fwd_bwd --specs=paper_16k,paper_16k_heavy \
  --impls=dense,mosaic_gpu --parts=false --iters=20 --out="$OUT/fwd_bwd.json" 2>&1 | grep -v "^  File\|^    " | tail -6

# --config must come before the --config.x overrides.
STEPS=${STEPS:-150}
COMMON="--config.log_every=25 --config.eval_every=100000 --config.checkpoint_every=0
  --config.data.use_tfds=False --config.warmup_steps=50"
timeout 170 python3 -m train.main --config=configs/small.py --workdir=/tmp/sparse $COMMON \
  --config.num_train_steps=$STEPS --config.l1_coeff=3e-4 --config.l1_warmup_steps=50 \
  > "$OUT/sparse.log" 2>&1; echo "sparse rc $?"
timeout 100 python3 -m train.main --config=configs/small.py:dense --workdir=/tmp/dense $COMMON \
  --config.num_train_steps=$((STEPS / 2)) > "$OUT/dense.log" 2>&1; echo "dense rc $?"
python3 -m train.throughput --workdirs=/tmp/sparse,/tmp/dense --out="$OUT/train_small.json" 2>&1 | tail -30

if [ "${FWD:-0}" = 1 ]; then
  timeout 90 python3 -m pallas_kernels.benchmark --specs=paper_16k_a60,paper_131k --parts=false --iters=10 \
    --out="$OUT/fwd.json" 2>&1 | grep -v "^  File\|^    " | tail -5
fi

# -k matches the module name too ("test_mgpu_..."), so select the GPU class by its name.
XLA_FLAGS="--xla_gpu_autotune_level=0" timeout -s INT ${TEST_TIMEOUT:-90} python3 -m pytest -q -p no:cacheprovider \
  tests/test_mgpu_train.py -k TrainGpuTest 2>&1 | tail -15 | tee "$OUT/tests_train.log"
