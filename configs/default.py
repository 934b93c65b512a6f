"""Base configuration: every field the trainer reads, with its default.

The other configs import `get_config` from here and change what differs.
Override anything on the command line, e.g. `--config.l1_coeff=3e-5` or
`--config.model.ffn_implementation=dense`.
"""

import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  _model(c)
  _data(c)
  _optimization(c)
  _layer_choice(c)
  _runtime(c)
  c.log_every = 50
  c.eval_every = 1000
  c.eval_batches = 8
  c.checkpoint_every = 1000
  c.keep_checkpoints = 3
  return c


def _model(c: ml_collections.ConfigDict) -> None:
  """The model: shapes, the FFN, dtypes and layouts (train/models/transformer.py)."""
  c.model = ml_collections.ConfigDict(dict(
      vocab_size=259,         # >= the tokenizer's (byte tokenizer: 259)
      d_model=512, n_layers=8, n_heads=8, n_kv_heads=8, d_ff=1408,
      rope_theta=10000.0, norm_eps=1e-6, init_std=0.02,
      ffn_gated=True,
      ffn_activation="relu",  # sparse kernels need relu; dense: silu/gelu too
      # None = auto (train/models/implementations.py: mosaic_gpu where it runs and wins,
      # else dense; the per-layer choice below); "dense" is the dense baseline.
      ffn_implementation=config_dict.placeholder(str),
      dtype="bfloat16", param_dtype="float32",
      remat=False,            # jax.checkpoint each block (memory for compute)
      scan_layers=False,      # lax.scan over stacked layers: depth-independent
                              # compile time (checkpoints differ in layout)
      scan_unroll=False,      # the scan fully unrolled: the same checkpoints, compile time
                              # by depth, no zero-filled residual buffers (faster, no remat)
      attention="auto",       # "cudnn" flash attention on GPUs (bf16), else "xla"
      interpret=False,        # run the FFN kernels in the Mosaic GPU interpreter (CPU,
                              # slow; with ffn_implementation=mosaic_gpu and bfloat16)
  ))


def _data(c: ml_collections.ConfigDict) -> None:
  """The input pipeline."""
  # Input (train/data/): local files (`files`) or a dataset by name (`dataset`), a tokenizer,
  # packed rows of seq_len + 1 tokens.
  c.data = ml_collections.ConfigDict(dict(
      dataset="twell_stdlib_text",  # or any prepared TFDS text dataset (lm1b)
      data_dir=config_dict.placeholder(str),  # TFDS data_dir
      use_tfds=True,          # offline corpus: prepare/read it through TFDS
      # Local files instead of `dataset`: comma-separated globs of .jsonl, .jsonl.gz,
      # .parquet and .txt files (train/data/files.py). Held out: the files of `eval_files`,
      # else the last `eval_fraction` of the documents (files in sorted order).
      files="", eval_files="", eval_fraction=0.01,
      index_cache_dir="~/.cache/twell_jax/jsonl_index",  # .jsonl line indexes ("": none)
      text_unit="paragraph",  # a .txt file's documents: "paragraph" (blank-line separated),
                              # "line" or "file"
      text_key="text", train_split="train", eval_split="validation",
      # "byte"; "sentencepiece" with spm_model=PATH.model; "hf" with
      # tokenizer_file=PATH/tokenizer.json (eos_token: the end-of-document token, if the
      # file's tokenizer_config.json does not name it)
      tokenizer="byte",
      spm_model=config_dict.placeholder(str),
      tokenizer_file=config_dict.placeholder(str),
      eos_token=config_dict.placeholder(str),
      # Processes that tokenize (train/data/workers.py); -1: auto (none for the byte
      # tokenizer, else half the CPU cores up to 16). The token stream is the same at any count.
      workers=-1,
      seq_len=512,
      prefetch=2,
  ))


def _optimization(c: ml_collections.ConfigDict) -> None:
  """The optimizer, its schedule and the sparsity terms."""
  # Optimization: AdamW, linear warm-up then cosine to min_lr_ratio * peak.
  c.num_train_steps = 10_000
  c.batch_size = 32           # global sequences per optimizer step
  c.grad_accum_steps = 1      # micro-batches per step (batch_size divisible)
  c.learning_rate = 3e-4
  c.warmup_steps = 500
  c.min_lr_ratio = 0.1
  c.adam_b1 = 0.9
  c.adam_b2 = 0.95
  c.adam_eps = 1e-8
  c.weight_decay = 0.1        # not applied to RMSNorm scales
  c.grad_clip = 1.0

  # Sparsity: loss = CE + l1_coeff(step) * mean over layers of the L1 term.
  c.l1_coeff = 2e-5
  c.l1_warmup_steps = 0       # linear ramp of the coefficient from 0
  # Per layer, a multiplier of its L1 term, comma-separated, one per layer (e.g. for 8
  # layers "1,0.25,0.25,0.25,0.5,1,1,2"); "" counts every layer alike.
  c.l1_layer_scales = ""
  # "per_token_sum": mean over tokens of sum over H of |h| (reference code);
  # "per_element_mean": mean over all M*H entries (paper text; = above / H).
  c.l1_normalization = "per_token_sum"

  # Dead neurons: a feature is dead once it has not fired for this many
  # training tokens; optionally re-draw its gate column every N steps.
  c.dead_window_tokens = 1_000_000
  c.dead_reinit = False
  c.dead_reinit_every = 1000


def _layer_choice(c: ml_collections.ConfigDict) -> None:
  """The per-layer FFN choice."""
  # Per-layer FFN choice (train/models/layer_choice.py): with ffn_implementation=None, each layer
  # trains on the dense FFN until its sparse FFN's predicted time (from its measured activity)
  # falls below sparse_below of the dense FFN's, and goes back above dense_above; decided
  # every `every` steps. The new step compiles in the background and runs from the first
  # step after its build is done: the device never waits for a build. wait_for_builds=True:
  # it runs `landing_steps` dense steps' time after its decision (more steps while faster
  # sparse steps run: train/training/choice_steps.py landing_lag), the loop waiting for its
  # build there, so a seed's run makes the same decisions and switches on the same steps
  # whatever the machine's speed, and a resumed run is the uninterrupted one bit for bit;
  # background=False: built in the loop, running from the next step.
  # Checkpoints keep the choice in use and the one pending.
  c.layer_choice = ml_collections.ConfigDict(dict(
      enabled=True,
      sparse="auto",          # the sparse layers' implementation; auto: what None resolves to
      every=20,
      sparse_below=0.9,       # predicted FFN time over dense (train/models/layer_choice.py)
      dense_above=1.0,
      background=True,
      landing_steps=200,      # dense steps' time a build has beside training: its choice
                              # lands there with wait_for_builds, else a build later than
                              # that counts towards build_timeout_s (enough for the builds
                              # measured at the paper shape: docs/performance.md)
      landing_by_layers=False,  # landing_steps is for a step with every layer sparse; one
                                # with fewer lands in that share of it (at least a quarter)
      wait_for_builds=False,  # True: a choice lands on its step, the loop waiting for its
                              # build (reproducible switches); False: once built, before or
                              # after that step
      sparse_eval=True,       # held-out evaluations on the running choice's FFNs once their
                              # step is compiled (beside training, before each evaluation);
                              # dense FFNs until then, and with wait_for_builds
      build_timeout_s=120.0,  # the longest a build may be late for its landing; then training
                              # goes on with the running step (a build may never come back)
      bridge=True,            # run a step compiled at the start (`ahead`) while a choice
                              # builds, where predicted faster
                              # (train/training/choice_steps.py _bridge)
      ahead="256,1024:last",  # the steps compiled at the start, comma-separated: "K" (the
                              # first layer dense, the others at K hot features) or "K:last"
                              # (the last layer dense too); "" none
      column_floor=True,      # features on more than twice a fair share of a layer's entries
                              # stay hot (twell_jax.features.column_floor); False: K from the
                              # cost model alone
      hot_menu="",            # the K a layer may take, comma-separated ("256,512,1024,2048":
                              # a K between two raised to the next); "" any multiple of 256
  ))


def _runtime(c: ml_collections.ConfigDict) -> None:
  """Where a run starts from, its devices, compile cache and profile."""
  # Start from a Hugging Face Llama checkpoint instead of random weights (train/import_hf.py):
  # the model's shapes and tokenizer come from the directory. activation "hf" keeps its
  # hidden_act, "relu" switches the gate to ReLU (ReLUfication, configs/relufy.py);
  # tokenizer "hf" takes the directory's, "config" keeps data.tokenizer as set here.
  c.init_from_hf = ml_collections.ConfigDict(dict(
      path=config_dict.placeholder(str),
      activation="hf",
      tokenizer="hf",
  ))
  # Devices (train/runtime/mesh.py): a ("data", "fsdp") mesh over all devices of all processes;
  # -1 takes the devices the other axis leaves. Batches are split over both axes; parameters
  # and optimizer state are split over "fsdp" (fsdp=1: replicated, plain data parallelism).
  # Several hosts: fsdp = devices per host keeps the weight gathers on the fast links.
  # shard_optimizer: AdamW's moments split over every axis, "data" included (ZeRO stage 1:
  # gradients reduce-scattered, each device updates 1/N, the parameters gathered back in
  # f32): less memory per device, a slower step on 2 GPUs (docs/performance.md).
  # gradient_reduction (data-only meshes): "per_device" runs the step per device and reduces
  # the gradients once after the backward; "gspmd" lets XLA reduce them inside the backward
  # as they appear; "auto" picks per_device (train/state/steps.py).
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, shard_optimizer=False,
                                          gradient_reduction="auto"))

  # Compiled programs kept across runs and resumes on a GPU (JAX's persistent compilation
  # cache; the per-layer choice's train steps take tens of seconds each to build at large
  # shapes). Empty: off.
  c.compilation_cache_dir = "~/.cache/twell_jax/jax"

  # Trace `profile.steps` steps from step `profile.first_step` (jax.profiler, with a Perfetto
  # trace) into workdir/profile: TensorBoard's profile plugin or ui.perfetto.dev reads it.
  c.profile = ml_collections.ConfigDict(dict(first_step=0, steps=0))


def apply_variant(c: ml_collections.ConfigDict, variant: str | None):
  """`--config=configs/X.py:dense` gives the dense-FFN baseline (SiLU-gated, no L1) of X."""
  if variant == "dense":
    c.model.ffn_implementation = "dense"
    c.model.ffn_activation = "silu"
    c.l1_coeff = 0.0
  elif variant:
    raise ValueError(f"unknown variant {variant!r}; expected 'dense' or none")
  return c
