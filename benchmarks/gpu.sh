#!/bin/bash
# The GPU entry point: runs the named parts in order, each with its own time limit, on a
# Hopper machine from the repository root. JSON and logs go to $OUT (default /tmp/out); copy
# the JSON into benchmarks/results/<device>/ to keep it.
#
#   bash benchmarks/gpu.sh kernels tests          # the kernel benchmark, then the GPU tests
#   SPECS=paper_16k_skew bash benchmarks/gpu.sh kernels
#
# Parts, by kind (benchmarks/ keeps the same grouping):
# The product's numbers (benchmarks/*.py):
#   kernels   benchmarks.kernels, forward and forward + backward ($SPECS, $FWD_BWD_SPECS)
#   breakdown the same with per-kernel CUPTI times, XLA command buffers off
#   e2e       benchmarks.e2e (whole-model training and inference, sparse vs dense)
#   whole_run benchmarks.whole_run: whole training commands from random initialisation, dense
#             SiLU and sparse twice, concurrently one GPU each where there are several, started
#             $WHOLE_RUN_STAGGER (30) s apart ($WHOLE_RUN_FLAGS; --runs=...,sparse+KEY=VALUE
#             adds a run with config overrides). One at a time, alone on one GPU (builds are
#             faster alone on the host): CUDA_VISIBLE_DEVICES=0 and --noparallel, one call per
#             run or two, joined by whole_run --runs= --merge=a,b
#   time_to_quality benchmarks.time_to_quality: per seed ($TTQ_FLAGS, e.g. --seeds=0,1,2) dense
#             SiLU, sparse at equal steps and sparse at dense's wall-clock, one at a time on
#             the first GPU, or one on each GPU at once with --gpus=0,1 in $TTQ_FLAGS
#             (starts --stagger_s=30 s apart); carries on from $TTQ_OUT (default the committed
#             benchmarks/results/h200/time_to_quality.json) and starts no run predicted to end
#             past $TTQ_BUDGET (540) s: repeat the call until every seed's three runs are in;
#             every sparse run is also merged into the table of levers $TTQ_LEVERS (default
#             benchmarks/results/h200/time_to_quality_levers.json)
#   decode    benchmarks.decode: decode tokens/s with the dense FFN and with the exact sparse
#             decode FFN (decode_ffn=auto), both with the default decode attention, the
#             bandwidth ceiling, exactness ($DECODE_FLAGS)
#   scaling   benchmarks.scaling: sparse and dense training data parallel over 1, 2, 4, ... and
#             all GPUs ($SCALING_FLAGS)
#   node      benchmarks.scaling at the paper 1.5B and 2B depths ($NODE_LAYERS, default 28 38)
#             over all GPUs ($NODE_MESHES, default 1xN: fsdp over N), sparse (batch 8 per GPU,
#             $NODE_SPARSE_FLAGS) and dense SiLU (batch 4 per GPU, 2 micro-batches,
#             $NODE_DENSE_FLAGS; $NODE_MODELS: one of them), merged into node.json
#   data      benchmarks.data_pipeline (tokens/s by worker count, 32k SentencePiece and a 32k
#             BPE tokenizer.json, parquet shards; $SPM_MODEL: a .model to use instead of
#             training one), then the paper 0.5B shape trained through train.main on those
#             parquet shards with that tokenizer.json ($DATA_STEPS steps; the log's data wait)
#   lm_eval   benchmarks.lm_eval_check: local tasks through our lm-eval backend and through
#             lm-eval's hf model (float32, item by item), and loglikelihood requests/s with the
#             sparse prefill against dense ($LM_EVAL_MODEL: default --trained=paper_0p5b, the
#             decode part's cached weights, trained first if missing; or --workdir=W;
#             $LM_EVAL_FLAGS). Needs lm-eval, datasets and their needs the image lacks as
#             wheels in .whl
#   generate  trains the paper's 0.5B shape for $GEN_STEPS steps (offline corpus, byte tokenizer)
#             through train.main, then train.generate at batch $GEN_BATCHES (decode tokens/s,
#             JSON per run) with the default FFN choice (dense decode) and with the sparse
#             kernels in every layer (prefill and decode), and train.report
# Acceptance checks (benchmarks/acceptance/) and the GPU tests:
#   tests     the GPU tests (pytest -m gpu)
#   resume    benchmarks.acceptance.kill_resume: SIGKILL a run on all GPUs, resume, compare
#             ($RESUME_FLAGS)
#   matrix    benchmarks.acceptance.matrix: every config x FFN x mesh of this machine through
#             the CLIs (train, SIGKILL, resume, same state, evaluate, generate, export), then
#             the kernels at public model shapes (benchmarks.sweeps.shapes) ($MATRIX_FLAGS)
#   multiprocess benchmarks.acceptance.multiprocess: one process per GPU on $MP_PROCESSES
#             (default all) GPUs: lose a process, the coordinator, every process; resume to the
#             same state; evaluate, generate, export; tokens/s against one process ($MP_FLAGS,
#             e.g. --parts=checks, --merge=a.json), into multiprocess_<N>.json
# Tuning sweeps (benchmarks/sweeps/):
#   sweep     benchmarks.sweeps.sweep ($SWEEP, default train)
#   captured  benchmarks.sweeps.captured (trains the paper shape, captures activations, times
#             the kernels on them)
#   activity_sweep benchmarks.sweeps.activity_sweep: a from-init run's captured activity, and
#             the kernels at 50-800 active per token with its skew ($SWEEP_FLAGS; with
#             --skews_from=benchmarks/results/h200/activity_sweep.json no run; with
#             --capture_steps=300,500 --stop_at_last_capture --actives= the early captures;
#             --capture_steps=2500 --actives=200: the last layer as trained)
#   shapes    benchmarks.sweeps.shapes alone ($SHAPES_FLAGS)
#   decode_ffn benchmarks.sweeps.decode_ffn: the few-row sparse FFN against dense by rows and
#             union, and the tile sweep ($DECODE_FFN_FLAGS, default --sweep)
# Probes (benchmarks/probes/):
#   registers ptxas register / spill report of every kernel
#   l2        the L2 row-gather ceiling probe
#   profile   benchmarks.probes.forward_profile (prefill and per-layer forward kernels, trained
#             weights)
set -o pipefail
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1 PYTHONPATH=.:$PYTHONPATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SPECS=${SPECS:-paper_16k,paper_16k_heavy,paper_16k_skew,paper_16k_extreme}
FWD_BWD_SPECS=${FWD_BWD_SPECS:-$SPECS}
# Wheels for what the image lacks (ml_collections; lm-eval, datasets and their needs), if
# carried in .whl; installed again when the carried set changes.
if ls .whl/*.whl >/dev/null 2>&1 && [ "$(ls .whl)" != "$(cat /tmp/site/.wheels 2>/dev/null)" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && ls .whl > /tmp/site/.wheels
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PYTHONPATH
# SentencePiece tokenizers trained on this image's corpora by an earlier call, if carried in
# .tokenizers (a model and its record): kept where the record names the same corpus (its
# sha256) and options, else trained again (train.corpus.build_tokenizer), ~30-45 s a machine.
if ls .tokenizers/*.model >/dev/null 2>&1; then
  mkdir -p ~/.cache/twell_jax/tokenizers && cp -n .tokenizers/* ~/.cache/twell_jax/tokenizers/
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader \
  | tee "$OUT/gpu.txt"
quiet() { grep -v '^\s*File\|^\s\s\s\s[a-z_]\|xla_bridge\|^{'; }

parts=("$@"); [ ${#parts[@]} = 0 ] && parts=(kernels tests)
for part in "${parts[@]}"; do
  echo "=== $part ($(date +%T))"
  case $part in
    kernels)
      timeout ${T_FWD:-240} python3 -m benchmarks.kernels --mode=fwd --specs=$SPECS \
        --out="$OUT/kernels_fwd.json" 2>&1 | quiet | tail -12
      timeout ${T_BWD:-300} python3 -m benchmarks.kernels --mode=fwd_bwd --specs=$FWD_BWD_SPECS \
        --out="$OUT/kernels_fwd_bwd.json" 2>&1 | quiet | tail -12 ;;
    breakdown)
      XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout ${T_BD:-300} python3 -m benchmarks.kernels \
        --mode=fwd_bwd --specs=${BD_SPECS:-paper_16k_skew} --breakdown --iters=10 \
        --out="$OUT/kernels_breakdown.json" 2>&1 | quiet > "$OUT/breakdown.log"
      tail -40 "$OUT/breakdown.log" ;;
    sweep)
      timeout ${T_SWEEP:-400} python3 -m benchmarks.sweeps.sweep --what=${SWEEP:-train} \
        --specs=${SWEEP_SPECS:-paper_16k_skew} --out="$OUT/sweep.json" 2>&1 | quiet | tail -20 ;;
    captured)
      timeout ${T_CAPTURED:-560} python3 -m benchmarks.sweeps.captured --out="$OUT/captured.json" \
        ${CAPTURED_FLAGS} 2>&1 | tee "$OUT/captured.log" | quiet | tail -60 ;;
    e2e)
      XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.95} timeout ${T_E2E:-560} python3 -m benchmarks.e2e --out="$OUT/e2e.json" ${E2E_FLAGS} \
        2>&1 | tee "$OUT/e2e.log" | quiet | tail -60 ;;
    tests)
      XLA_FLAGS="--xla_gpu_autotune_level=0" timeout -s INT ${T_TESTS:-450} python3 -m pytest -q \
        -p no:cacheprovider -m gpu tests/ > "$OUT/tests.log" 2>&1; tail -8 "$OUT/tests.log" ;;
    registers)
      MOSAIC_GPU_DUMP_PTXAS=1 timeout 200 python3 -m benchmarks.probes.registers 2>&1 \
        | grep -E "Compiling entry|Used [0-9]+ registers" \
        | sed -E 's/.*entry function .([a-z_0-9]+).*/\1/; s/ptxas info *: //' | paste - - \
        | sort | uniq -c | tee "$OUT/registers.txt" ;;
    whole_run)
      timeout ${T_WHOLE:-590} python3 -m benchmarks.whole_run --out="$OUT/whole_run.json" \
        --plot="$OUT/whole_run.png" --workdir=/tmp/twell_whole_run \
        $([ $(nvidia-smi -L | wc -l) -gt 1 ] && echo --parallel --stagger_s=${WHOLE_RUN_STAGGER:-30}) \
        ${WHOLE_RUN_FLAGS} 2>&1 \
        | tee /tmp/twell_whole_run.log | grep -E "^  |^wall|rror"
      cp /tmp/twell_whole_run.log /tmp/twell_whole_run/whole_run.log
      tar czf "$OUT/whole_run_logs.tgz" -C /tmp/twell_whole_run $(cd /tmp/twell_whole_run && ls *.log) ;;
    time_to_quality)
      TTQ_OUT=${TTQ_OUT:-benchmarks/results/h200/time_to_quality.json}
      TTQ_LEVERS=${TTQ_LEVERS:-benchmarks/results/h200/time_to_quality_levers.json}
      # One GPU unless the runs are spread over several (--gpus): each then names its own.
      case "$TTQ_FLAGS" in *--gpus=*) gpu_env=();; *) gpu_env=(CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0});; esac
      env "${gpu_env[@]}" timeout ${T_TTQ:-590} \
        python3 -m benchmarks.time_to_quality --out="$TTQ_OUT" --plot="$OUT/time_to_quality.png" \
        --levers_out="$TTQ_LEVERS" --budget_s=${TTQ_BUDGET:-540} ${TTQ_FLAGS} 2>&1 \
        | tee "$OUT/time_to_quality.log" | grep -E "^  |rror"
      cp "$TTQ_OUT" "$TTQ_LEVERS" "$OUT/"
      # The runs' train logs (decisions, landings, the bridge's predictions) beside the data.
      (cd /tmp/twell_time_to_quality && tar czf "$OUT/time_to_quality_logs.tgz" *.log) ;;
    data)
      timeout ${T_DATA:-300} python3 -m benchmarks.data_pipeline --out="$OUT/data_pipeline.json" \
        --plot="$OUT/data_pipeline.png" \
        --keep=/tmp/twell_data_files $([ -n "$SPM_MODEL" ] && echo --spm_model=$SPM_MODEL) \
        2>&1 | tee "$OUT/data_pipeline.log" | grep -E "workers|rror"
      timeout ${T_DATA_RUN:-400} python3 -m train.main --config=configs/paper_0p5b.py \
        --workdir=/tmp/twell_data_run --config.data.files='/tmp/twell_data_files/part-*.parquet' \
        --config.data.tokenizer=hf --config.data.tokenizer_file=/tmp/twell_data_files/tokenizer.json \
        --config.model.vocab_size=32000 --config.num_train_steps=${DATA_STEPS:-300} \
        --config.batch_size=8 --config.log_every=25 --config.eval_every=${DATA_STEPS:-300} \
        --config.checkpoint_every=0 --config.learning_rate=1e-3 --config.warmup_steps=100 \
        --config.l1_coeff=3e-5 2>&1 | tee "$OUT/data_run.log" | grep -E "data wait|eval step|rror" \
        | cut -c1-220 ;;
    activity_sweep)
      timeout ${T_ACTIVITY:-590} python3 -m benchmarks.sweeps.activity_sweep \
        --out="$OUT/activity_sweep.json" ${SWEEP_FLAGS} 2>&1 | tee "$OUT/activity_sweep.log" \
        | grep -E "^  |^skew|^[a-z_]+ +[0-9]|rror" ;;
    l2)
      timeout 200 python3 -m benchmarks.probes.l2_rows --out="$OUT/l2_rows.json" 2>&1 | quiet | tail -20 ;;
    profile)
      timeout ${T_PROFILE:-500} python3 -m benchmarks.probes.forward_profile \
        --out="$OUT/forward_profile.json" 2>&1 | tee "$OUT/profile.log" | quiet | tail -150 ;;
    generate)
      GW=${GEN_WORKDIR:-/tmp/twell_gen_0p5b}
      timeout ${T_GEN_TRAIN:-420} python3 -m train.main --config=configs/paper_0p5b.py \
        --workdir="$GW" --config.data.dataset=twell_stdlib_text --config.data.tokenizer=byte \
        --config.data.use_tfds=False --config.batch_size=8 --config.grad_accum_steps=1 \
        --config.model.remat=False --config.num_train_steps=${GEN_STEPS:-300} \
        --config.learning_rate=1e-3 --config.warmup_steps=100 --config.l1_coeff=${GEN_L1:-3e-5} \
        --config.log_every=50 --config.eval_every=${GEN_STEPS:-300} --config.eval_batches=2 \
        --config.checkpoint_every=${GEN_STEPS:-300} 2>&1 | quiet \
        | grep -E "step [0-9]+/|eval step|rror" | tail -3 | cut -c1-600
      # auto: prefill FFN per layer by logged activity, dense decode (the defaults);
      # mosaic_gpu: the sparse kernels in every layer, at prefill and at decode.
      for b in ${GEN_BATCHES:-1 16}; do
        for ffn in auto mosaic_gpu; do
          decode=$([ $ffn = auto ] && echo dense || echo same)
          timeout ${T_GEN:-240} python3 -m train.generate --workdir="$GW" \
            --prompt="def main(argv):" --num_samples=$b --max_new_tokens=256 \
            --stop_at_eos=false --prefill_ffn=$ffn --decode_ffn=$decode \
            --out="$OUT/generate_b${b}_$ffn.json" 2>&1 | quiet | tail -1
        done
      done
      timeout 200 python3 -m train.report --workdir="$GW" --out="$OUT/report" 2>&1 | quiet | tail -1 ;;
    scaling)
      XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.95} timeout ${T_SCALING:-560} \
        python3 -m benchmarks.scaling --out="$OUT/scaling.json" ${SCALING_FLAGS} 2>&1 \
        | tee "$OUT/scaling.log" | quiet | tail -20 ;;
    node)
      n=$(nvidia-smi -L | wc -l); node_files=()
      for layers in ${NODE_LAYERS:-28 38}; do
        for model in ${NODE_MODELS:-sparse dense}; do
          [ $model = sparse ] && flags=${NODE_SPARSE_FLAGS:---batch_per_device=8} \
            || flags=${NODE_DENSE_FLAGS:---batch_per_device=4 --grad_accum=2}
          XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.95} timeout ${T_NODE:-400} \
            python3 -m benchmarks.scaling --models=$model --layers=$layers \
            --meshes=${NODE_MESHES:-1x$n} --choose_mesh=1x$n --options=trainer \
            --train_steps=${NODE_TRAIN_STEPS:-500} $flags \
            --out="$OUT/node_${layers}_$model.json" 2>&1 | tee -a "$OUT/node.log" \
            | grep -E "^  |^sparse|rror"
          [ -f "$OUT/node_${layers}_$model.json" ] && node_files+=("$OUT/node_${layers}_$model.json")
        done
      done
      python3 -m benchmarks.scaling --merge=$(IFS=,; echo "${node_files[*]}") --out="$OUT/node.json" ;;
    multiprocess)
      n=${MP_PROCESSES:-$(nvidia-smi -L | wc -l)}
      timeout ${T_MP:-590} python3 -m benchmarks.acceptance.multiprocess --processes=$n \
        --workdir=/tmp/twell_multiprocess --out="$OUT/multiprocess_$n.json" ${MP_FLAGS} 2>&1 \
        | tee "$OUT/multiprocess_$n.log" | grep -E "processes, |rror" ;;
    resume)
      timeout ${T_RESUME:-560} python3 -m benchmarks.acceptance.kill_resume --out="$OUT/kill_resume.json" \
        ${RESUME_FLAGS:---config=configs/small.py --steps=60 --every=20 -- \
          --config.mesh.data=-1 --config.batch_size=16 --config.data.seq_len=512 \
          --config.model.ffn_implementation=mosaic_gpu} 2>&1 \
        | quiet | tail -30 ;;
    matrix)
      timeout ${T_MATRIX:-3000} python3 -m benchmarks.acceptance.matrix --out="$OUT/matrix.json" \
        ${MATRIX_FLAGS} 2>&1 | tee "$OUT/matrix.log" | grep -E "^\[|passed|  [a-z]" ;;
    shapes)
      timeout ${T_SHAPES:-900} python3 -m benchmarks.sweeps.shapes --out="$OUT/shapes.json" \
        ${SHAPES_FLAGS} 2>&1 | quiet | tail -20 ;;
    decode)
      XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.95} timeout ${T_DECODE:-560} \
        python3 -m benchmarks.decode --out="$OUT/decode.json" ${DECODE_FLAGS} 2>&1 \
        | tee "$OUT/decode.log" | grep -E "^  |^device" ;;
    decode_ffn)
      timeout ${T_DECODE_FFN:-400} python3 -m benchmarks.sweeps.decode_ffn --out="$OUT/decode_ffn.json" \
        ${DECODE_FFN_FLAGS:---sweep} 2>&1 | tee "$OUT/decode_ffn.log" | grep -E "^M |^break|^  \{" ;;
    lm_eval)
      timeout ${T_LM_EVAL:-400} python3 -m benchmarks.lm_eval_check \
        ${LM_EVAL_MODEL:---trained=paper_0p5b} --out="$OUT/lm_eval_check.json" ${LM_EVAL_FLAGS} \
        2>&1 | tee "$OUT/lm_eval.log" | grep -E "^cross-check|^loglikelihood|rror" ;;
    *) echo "unknown part: $part" ;;
  esac
done
