"""The training loop: data -> jitted step -> metrics, eval and checkpoints.

`train_and_evaluate(config, workdir)` trains `config.num_train_steps` steps.
If DIR/checkpoints holds a usable checkpoint it resumes from it (params,
optimizer state, step, RNG, dead-feature counters and data position), so
rerunning the same command after a crash continues the same run: on one
machine the resumed run ends with bit-identical parameters, because every
step is a pure function of (state, batch) and the batch stream is restored
exactly.

Devices: a ("data", "fsdp") mesh over every device of every process (config
`mesh`, see `train.sharding`): batches split over both axes, parameters and
optimizer state split over "fsdp" (replicated with fsdp = 1: data parallel),
the FFN and the loss run per device under `jax.shard_map`. Each process reads
its own share of the documents.
"""

import dataclasses
import json
import os
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from train import checkpointing
from train import config_checks
from train import data as data_lib
from train import hf_init
from train import layer_choice as layer_choice_lib
from train import metrics as metrics_lib
from train import model as model_lib
from train import optim
from train import preemption
from train import sharding as sharding_lib
from train import sparsity
from train import steps as steps_lib


ConfigError = config_checks.ConfigError

# XLA options for a train step compiled without autotuning: GEMMs on cuBLAS's own heuristics
# (Triton GEMMs untuned are several times slower). Autotuning runs candidate kernels on the
# device, which a running training loop keeps busy: a background build with it takes about 5x
# longer than alone (`benchmarks.probes.background_build`).
NO_AUTOTUNE = {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False}


def make_mesh(mesh_cfg=None) -> jax.sharding.Mesh:
  """The config's ("data", "fsdp") mesh over all devices (ConfigError if it does not fit)."""
  try:
    return sharding_lib.make_mesh(mesh_cfg)
  except sharding_lib.MeshError as e:
    raise ConfigError(f"config.mesh: {e}") from e


def check_config(cfg, n_devices: int, n_processes: int):
  """Raises ConfigError naming the first bad field (`train.config_checks.check`)."""
  config_checks.check(cfg, n_devices, n_processes)


class Trainer:
  """Everything built from the config that the loop and eval share."""

  def __init__(self, cfg, mesh=None):
    self.cfg = cfg
    self.mesh = mesh or make_mesh(cfg.get("mesh"))
    check_config(cfg, self.mesh.size, jax.process_count())
    self.model_cfg = model_lib.ModelConfig.from_config(cfg.model)
    self.lm = model_lib.LanguageModel(self.model_cfg)
    self.tokenizer = data_lib.make_tokenizer(cfg.data)
    if self.tokenizer.vocab_size > self.model_cfg.vocab_size:
      raise ConfigError(f"model.vocab_size={self.model_cfg.vocab_size} is "
                       f"below the tokenizer's {self.tokenizer.vocab_size}")
    self.tx = optim.make_optimizer(cfg)
    self.replicated = NamedSharding(self.mesh, P())
    self.batch_sharding = sharding_lib.batch_sharding(self.mesh)
    self.eval_sharding = sharding_lib.eval_sharding(self.mesh)
    shapes = jax.eval_shape(self.init_state, jax.random.key(0))
    # The optimizer's moments, and the gradients inside the step, share one layout.
    self.grad_sharding = sharding_lib.moment_shardings(
        shapes["params"], self.mesh, scan_layers=self.model_cfg.scan_layers,
        shard_optimizer=bool((cfg.get("mesh") or {}).get("shard_optimizer", False)))
    self.state_sharding = sharding_lib.state_shardings(
        shapes, self.tx, self.mesh, scan_layers=self.model_cfg.scan_layers,
        moments=self.grad_sharding)

  def init_state(self, key):
    params = self.lm.init_params(key)
    return {"params": params, "opt_state": self.tx.init(params),
            "step": jnp.int32(0), "rng": jax.random.key_data(key),
            "since": sparsity.init_since(self.model_cfg.n_layers,
                                         self.model_cfg.d_ff)}

  def new_state(self, key):
    """A fresh train state, laid out on the mesh (`state_sharding`)."""
    return jax.jit(self.init_state, out_shardings=self.state_sharding)(key)

  def abstract_state(self):
    """The state's shapes with their shardings on this mesh (the restore target)."""
    shapes = jax.eval_shape(self.init_state, jax.random.key(0))
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, self.state_sharding)

  def jit_train_step(self, layer_ffn=None):
    """The jitted step; `layer_ffn` (a `LayerChoice.key`: L implementation names and L
    numbers of hot features) overrides the model's FFNs."""
    lm = self.lm
    if layer_ffn is not None:
      names, hot = layer_ffn
      lm = model_lib.LanguageModel(dataclasses.replace(
          self.model_cfg, ffn_layer_implementations=tuple(names),
          ffn_layer_hot_features=tuple(hot)))
    step = steps_lib.make_train_step(lm, self.tx, self.cfg,
                                     grad_sharding=self.grad_sharding)
    return jax.jit(sharding_lib.traced_in(self.mesh, step),
                   in_shardings=(self.state_sharding, self.batch_sharding),
                   out_shardings=(self.state_sharding, self.replicated),
                   donate_argnums=0)

  def compile_train_step(self, layer_ffn, state_spec, batch_spec, *, autotune: bool = True):
    """`jit_train_step(layer_ffn)` compiled ahead of time for these argument types (and
    shardings); `autotune=False` compiles a GPU step with `NO_AUTOTUNE`."""
    lowered = self.jit_train_step(layer_ffn).lower(state_spec, batch_spec)
    untuned = not autotune and jax.default_backend() == "gpu"
    return lowered.compile(compiler_options=NO_AUTOTUNE if untuned else None)

  def layer_choice(self) -> "layer_choice_lib.LayerChoice | None":
    """The per-layer FFN choice the config asks for, or None (see configs/default.py)."""
    lc, mc = self.cfg.get("layer_choice"), self.model_cfg
    if (lc is None or not lc.enabled or mc.ffn_implementation is not None
        or mc.ffn_activation != "relu"):
      return None
    sparse = lc.sparse
    # One FFN call's tokens: a micro-batch's share of one device.
    tokens = (self.cfg.batch_size // self.cfg.grad_accum_steps // self.mesh.size
              * self.cfg.data.seq_len)
    if sparse == "auto":
      sparse = ffn_implementation_in_use(self, tokens)
    if sparse == "dense":
      return None
    return layer_choice_lib.LayerChoice(mc.n_layers, mc.d_ff, sparse=sparse,
                                        sparse_below=lc.sparse_below,
                                        dense_above=lc.dense_above,
                                        d_model=None if mc.interpret else mc.d_model,
                                        tokens=tokens)

  def sort_features(self, state, order):
    """`state` with each layer's hidden features in `order` [L, H] (the parameters, the
    optimizer state and the dead-feature counters alike: the model computes the same function,
    the run continues the same optimization)."""
    if not hasattr(self, "_sort_features"):
      def permute(state, order):
        since = jnp.take_along_axis(state["since"], order, axis=1)
        return {**model_lib.permute_ffn_features(
            {k: v for k, v in state.items() if k != "since"}, order), "since": since}
      self._sort_features = jax.jit(permute, out_shardings=self.state_sharding,
                                    donate_argnums=0)
    return self._sort_features(state, jnp.asarray(order))

  def put_batch(self, local: np.ndarray, sharding) -> jax.Array:
    return jax.make_array_from_process_local_data(sharding, local)

  def eval_batches(self):
    cfg = self.cfg
    rows = cfg.batch_size // cfg.grad_accum_steps // jax.process_count()
    return data_lib.eval_batches(
        cfg.data, self.tokenizer, seq_len=cfg.data.seq_len, rows=rows,
        num_batches=cfg.eval_batches, shard_index=jax.process_index(),
        shard_count=jax.process_count())

  def evaluate(self, params, batches) -> dict:
    """Held-out loss, perplexity and per-layer sparsity over `batches`."""
    if not hasattr(self, "_eval_step"):  # compile once per Trainer
      self._eval_step = jax.jit(sharding_lib.traced_in(
          self.mesh, steps_lib.make_eval_step(self.lm)))
    eval_step = self._eval_step
    tot = None
    for b in batches:
      out = eval_step(params, self.put_batch(b, self.eval_sharding))
      out = jax.device_get(out)
      if tot is None:
        tot = {k: np.array(v, np.float64) for k, v in out.items()}
        tot["fired"] = np.array(out["fired"], bool)
        tot["max_tile_nnz"] = np.array(out["max_tile_nnz"])
      else:
        for k in ("ce_sum", "tokens", "active_per_token", "overflow_rows"):
          tot[k] = tot[k] + out[k]
        tot["max_tile_nnz"] = np.maximum(tot["max_tile_nnz"],
                                         out["max_tile_nnz"])
        tot["fired"] = tot["fired"] | np.asarray(out["fired"], bool)
    n = len(batches)
    loss = float(tot["ce_sum"] / tot["tokens"])
    h = self.model_cfg.d_ff
    active = tot["active_per_token"] / n
    return {
        "loss": loss, "perplexity": float(np.exp(min(loss, 80.0))),
        "tokens": int(tot["tokens"]),
        "active_per_token": [float(x) for x in active],
        "sparsity": [float(1.0 - x / h) for x in active],
        "max_tile_nnz": [int(x) for x in tot["max_tile_nnz"]],
        "overflow_rows": [int(x) for x in tot["overflow_rows"]],
        "never_fired_fraction": [float(x) for x in
                                 1.0 - tot["fired"].mean(axis=-1)],
    }


def ffn_implementation_in_use(tr: "Trainer", tokens: int) -> str:
  """What implementation=None resolves to for one layer's FFN call here."""
  mc = tr.model_cfg
  if mc.ffn_implementation is not None:
    return mc.ffn_implementation
  try:
    from twell_jax import api  # pylint: disable=g-import-not-at-top
    dt = model_lib.DTYPES[mc.dtype]
    sds = jax.ShapeDtypeStruct
    return api.default_implementation(
        sds((tokens, mc.d_model), dt), sds((mc.d_model, mc.d_ff), dt),
        sds((mc.d_model, mc.d_ff), dt), sds((mc.d_ff, mc.d_model), dt),
        mc.ffn_activation, interpret=mc.interpret)
  except Exception as e:  # pylint: disable=broad-except
    return f"auto (undetermined: {type(e).__name__})"


def _all_process_states(data_state: dict) -> list[dict]:
  """Every process's data position, in process order (a collective).

  Orbax writes JSON items from the primary process only, so positions are
  gathered first: each process's JSON is sent as padded uint8 bytes.
  """
  if jax.process_count() == 1:
    return [data_state]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  raw = np.frombuffer(json.dumps(data_state).encode(), np.uint8)
  lengths = multihost_utils.process_allgather(np.int32(raw.size))
  padded = np.zeros(int(np.max(lengths)), np.uint8)
  padded[:raw.size] = raw
  every = multihost_utils.process_allgather(padded)
  return [json.loads(bytes(every[i, :lengths[i]]).decode())
          for i in range(jax.process_count())]


def _my_data_state(saved: dict) -> dict:
  states = saved["processes"]
  if len(states) != jax.process_count():
    raise checkpointing.CheckpointError(
        f"the checkpoint holds data positions of {len(states)} processes; "
        f"resume with that many processes (now {jax.process_count()})")
  return states[jax.process_index()]


def _meta(cfg, step: int, layer_ffn=None, pending=None) -> dict:
  import twell_jax  # pylint: disable=g-import-not-at-top
  meta = {"step": int(step), "config": cfg.to_dict(),
          "twell_jax_version": getattr(twell_jax, "__version__", "?")}
  if layer_ffn is not None:
    # The per-layer FFN choice in use, and the one decided and not landed yet with its step:
    # a resumed run continues with them (same numerics, the same steps).
    meta["layer_implementations"] = list(layer_ffn[0])
    meta["layer_hot_features"] = list(layer_ffn[1])
  if pending is not None:
    (names, hot), land = pending
    meta["pending_layer_choice"] = {"implementations": list(names), "hot_features": list(hot),
                                    "step": int(land)}
  return meta


def _log_line(step, m, d_ff, tokens_per_s, progress) -> str:
  act = np.asarray(m["active_per_token"])
  dead = np.asarray(m["dead_fraction"])
  return (f"{progress.eta_line(step)} | loss {float(m['loss']):.4f} "
          f"ce {float(m['cross_entropy']):.4f} "
          f"l1 {float(m['l1_term']):.3g}x{float(m['l1_coeff']):.2g} "
          f"lr {float(m['learning_rate']):.2e} "
          f"gnorm {float(m['grad_norm']):.3f} {tokens_per_s:,.0f} tok/s | "
          f"active/token {' '.join(f'{a:.1f}' for a in act)} of {d_ff} "
          f"max/tile {' '.join(str(int(x)) for x in m['max_tile_nnz'])} "
          f"overflow {' '.join(str(int(x)) for x in m['overflow_rows'])} "
          f"dead {' '.join(f'{x:.2f}' for x in dead)}")


def use_compilation_cache(path: str | None, backend: str | None = None) -> str | None:
  """Turns on JAX's persistent compilation cache at `path` (~ expanded) on a GPU, unless
  the cache is already set (`--jax_compilation_cache_dir`); returns the directory in use.
  On the CPU nothing changes (the tests' programs compile in well under a second)."""
  current = jax.config.jax_compilation_cache_dir
  if current or not path or (backend or jax.default_backend()) != "gpu":
    return current or None
  path = os.path.expanduser(path)
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  logging.info("compiled programs are cached in %s (config.compilation_cache_dir)", path)
  return path


class _StepTracer:
  """Traces steps [first_step, first_step + steps) of `cfg.profile` into workdir/profile."""

  def __init__(self, profile_cfg, workdir: str):
    profile_cfg = profile_cfg or {}
    self.first = int(profile_cfg.get("first_step", 0))
    self.last = self.first + int(profile_cfg.get("steps", 0))
    self.dir = os.path.join(workdir, "profile")
    self.on = False

  def before(self, step: int) -> None:
    if step == self.first and self.last > self.first and jax.process_index() == 0:
      jax.profiler.start_trace(self.dir, create_perfetto_trace=True)
      self.on = True

  def after(self, done: int, outputs) -> None:
    if self.on and done >= self.last:
      jax.block_until_ready(outputs)
      self.stop()
      logging.info("traced steps %d-%d into %s", self.first + 1, done, self.dir)

  def stop(self) -> None:
    if self.on:
      jax.profiler.stop_trace()
      self.on = False


def _no_payback(choice, running, counts, heavy, tokens: int, steps_left: int,
                ffn_share: float) -> str | None:
  """Why the choice's new step would not pay for its build (None: it would).

  Saving: the predicted FFN time of the running step and of the new one
  (`LayerChoice.costs`, over the dense FFN's), the FFN being `ffn_share` of a dense step,
  over the steps left, in dense steps. Cost: `layer_choice.BUILD_COST_STEPS`. Steps, not
  seconds, so that the decision is the same in every run of a seed."""
  old = float(choice.costs(running, counts, tokens, heavy).mean())
  new = float(choice.costs(choice.key, counts, tokens, heavy).mean())
  saving = ffn_share * (old - new) * steps_left
  if saving > layer_choice_lib.BUILD_COST_STEPS:
    return None
  return (f"predicted to save {saving:.1f} dense steps' time over the {steps_left} steps "
          f"left, less than the {layer_choice_lib.BUILD_COST_STEPS:.0f} a build takes")


def train_and_evaluate(cfg, workdir: str, *, accept_config_change: bool = False,
                       allow_fresh_start: bool = False, hooks=()) -> dict:
  """Trains (resuming if possible); returns the last logged metrics.

  Before anything is built the config is checked (`config_checks.check`) and, on a
  workdir with checkpoints, compared with the one it was trained with
  (`config_checks.check_workdir`; `accept_config_change` accepts changes of the
  optimisation). `allow_fresh_start` lets a workdir whose checkpoints were all
  quarantined start over. A SIGTERM from here on stops training after the current
  step: the checkpoint of that step is written, then `preemption.Preempted` raised.
  `hooks`: callables hook(trainer, step, state, layer_ffn) run after every step (`step` steps
  done; `layer_ffn` the per-layer choice's key that step ran, or None), for measurements inside
  a run (`benchmarks.activity_sweep`); they must not change the state.
  """
  watch = preemption.Watch().install()
  try:
    return _train_and_evaluate(cfg, workdir, watch, accept_config_change=accept_config_change,
                               allow_fresh_start=allow_fresh_start, hooks=hooks)
  finally:
    watch.remove()


def _train_and_evaluate(cfg, workdir: str, watch: preemption.Watch, *,
                        accept_config_change: bool, allow_fresh_start: bool, hooks) -> dict:
  os.makedirs(workdir, exist_ok=True)
  use_compilation_cache(cfg.get("compilation_cache_dir"))
  hf_dir = (cfg.get("init_from_hf") or {}).get("path")
  if hf_dir:  # shapes and tokenizer of a Hugging Face checkpoint
    cfg = hf_init.configure(cfg, workdir)
  tr = Trainer(cfg)
  is_main = jax.process_index() == 0
  logging.info("Devices: %s; model %s", jax.devices(), tr.model_cfg)
  changed = config_checks.check_workdir(workdir, cfg.to_dict(), accept=accept_config_change)
  for path, old, new in changed["free"] + changed["acceptable"]:
    logging.warning("Config change on resume: %s: %r -> %r", path, old, new)
  logging.info("%s", sharding_lib.describe(tr.mesh, tr.state_sharding["params"],
                                           tr.grad_sharding))

  mngr, restored = checkpointing.restore_latest(
      workdir, tr.abstract_state(), every_steps=cfg.checkpoint_every,
      keep=cfg.keep_checkpoints, allow_fresh_start=allow_fresh_start)
  if is_main:  # The config of the run from here on (compared by the next resume).
    config_checks.write_workdir_config(workdir, cfg.to_dict())
  rows = cfg.batch_size // jax.process_count()
  packer = data_lib.PackedBatches(
      data_lib.make_source(cfg.data, cfg.data.train_split), tr.tokenizer,
      seq_len=cfg.data.seq_len, rows=rows, seed=cfg.seed,
      shard_index=jax.process_index(), shard_count=jax.process_count())
  if restored is None:
    start = 0
    state = tr.new_state(jax.random.key(cfg.seed))
    if hf_dir:
      state = hf_init.initial_state(tr, state, hf_dir)
  else:
    start, state = restored["step"], restored["state"]
    packer.set_state(_my_data_state(restored["data"]))
    logging.info("Resumed from checkpoint step %d", start)
  n_params = model_lib.count_params(state["params"])
  logging.info("Parameters: %s; FFN implementation: %s", f"{n_params:,}",
               ffn_implementation_in_use(
                   tr, cfg.batch_size // cfg.grad_accum_steps
                   // tr.mesh.size * cfg.data.seq_len))

  writer = metrics_lib.MetricWriter(workdir, enabled=is_main)
  if start == 0 and is_main:
    writer.write_text(0, "config", "```\n" + str(cfg) + "\n```")
  eval_data = tr.eval_batches() if cfg.eval_every > 0 else None
  prefetch = data_lib.Prefetcher(packer, depth=cfg.data.prefetch)
  progress = metrics_lib.Progress(cfg.num_train_steps, start)
  shape = (cfg.grad_accum_steps, rows // cfg.grad_accum_steps,
           cfg.data.seq_len + 1)
  choice = tr.layer_choice()
  pending = None   # (key, step): a choice decided, running from that step on
  if choice is None:
    train_step, steps, running = tr.jit_train_step(), None, None
  else:
    # Compiled ahead of time for the state's and the batch's exact types (no retrace at a
    # switch), without autotuning on a GPU: builds run beside training, where autotuning
    # takes about 5x longer, and a resumed run must build each choice's step alike.
    like = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
    state_spec = jax.tree.map(like, state)
    batch_spec = jax.ShapeDtypeStruct(
        (cfg.grad_accum_steps, cfg.batch_size // cfg.grad_accum_steps, cfg.data.seq_len + 1),
        np.int32, sharding=tr.batch_sharding)
    steps = layer_choice_lib.StepBuilds(
        lambda key: tr.compile_train_step(key, state_spec, batch_spec, autotune=False),
        background=cfg.layer_choice.background)
    lag = cfg.layer_choice.landing_steps if cfg.layer_choice.background else 0
    meta = (restored or {}).get("meta") or {}
    saved = meta.get("layer_implementations")
    if saved is not None and len(saved) == choice.n_layers:
      choice.current = list(saved)
      choice.hot = list(meta.get("layer_hot_features") or [0] * choice.n_layers)
    running = choice.key
    if meta.get("pending_layer_choice"):
      p = meta["pending_layer_choice"]
      pending = ((tuple(p["implementations"]), tuple(p["hot_features"])), p["step"])
      steps.request(pending[0])
      choice.current, choice.hot = list(pending[0][0]), list(pending[0][1])
    train_step = steps.get(running)
    mc = tr.model_cfg
    ffn_share = layer_choice_lib.ffn_flop_share(
        mc.d_model, mc.d_ff, mc.n_layers, mc.vocab_size, cfg.data.seq_len, mc.n_heads,
        mc.n_kv_heads, mc.ffn_gated)
    tokens_per_step = cfg.batch_size * cfg.data.seq_len
    logging.info("Per-layer FFN choice: dense until a layer's sparse FFN is predicted at "
                 "below %g of the dense one's time (train.layer_choice.CostModel), then %s "
                 "(back above %g); decided every %d steps (features sorted by popularity), "
                 "each choice running %d steps after its decision", choice.sparse_below,
                 choice.sparse, choice.dense_above, cfg.layer_choice.every, lag)
  last = {}
  t_last, tokens_since = time.time(), 0
  preempted = None
  tracer = _StepTracer(cfg.get("profile"), workdir)
  try:
    for step in range(start, cfg.num_train_steps):
      if pending is not None and step >= pending[1]:
        # A decided choice lands on its step, waiting for its build if it is not done: the
        # steps a run runs depend on its decisions alone.
        try:
          train_step, running = steps.get(pending[0]), pending[0]
          logging.info("step %d: now running FFN per layer %s (built in %.1f s)", step + 1,
                       choice.describe(running), steps.build_s.get(running, 0.0))
        except Exception as e:  # pylint: disable=broad-except  # training goes on as it runs
          logging.exception("building the train step for %s failed (%s: %s); training goes "
                            "on with %s", pending[0], type(e).__name__, e,
                            choice.describe(running))
          choice.current, choice.hot = list(running[0]), list(running[1])
        pending = None
      batch, data_state = next(prefetch)
      tracer.before(step)
      with jax.profiler.StepTraceAnnotation("train", step_num=step):
        state, m = train_step(state, tr.put_batch(batch.reshape(shape).astype(np.int32),
                                                  tr.batch_sharding))
      tracer.after(step + 1, m)
      done, ran = step + 1, running
      tokens_since += cfg.batch_size * cfg.data.seq_len
      if choice is not None and (done % cfg.layer_choice.every == 0 or done == 1):
        # This step's feature counts: the layers' choice and hot features, and the order
        # that puts each layer's hottest features first, applied to the state at once
        # (the running step's hot features then cover the hottest ones). Decisions fall on
        # the same steps in a resumed run as in an uninterrupted one (the choice in use and
        # the one pending are restored from the checkpoint), so both reorder the features
        # alike and switch on the same steps.
        counts, heavy = jax.device_get((m["feature_counts"], m["heavy_rows_by_hot"]))
        target = running if pending is None else pending[0]
        choice.current, choice.hot = list(target[0]), list(target[1])
        _, order = choice.update_from_counts(counts, tokens_per_step, heavy)
        state = tr.sort_features(state, order)
        if choice.key != target:
          land = done + lag
          why_not = ("it would land after the run ends" if land >= cfg.num_train_steps else
                     _no_payback(choice, target, counts, heavy, tokens_per_step,
                                 cfg.num_train_steps - land, ffn_share))
          if why_not:
            logging.info("step %d: FFN per layer -> %s predicted, not built: %s", done,
                         choice.describe(), why_not)
            choice.current, choice.hot = list(target[0]), list(target[1])
          else:
            logging.info("step %d: FFN per layer -> %s (predicted %s), running from step %d",
                         done, choice.describe(),
                         " ".join(f"{r:.2f}" for r in choice.predicted), land + 1)
            pending = (choice.key, land)
            steps.request(choice.key)
      for hook in hooks:
        hook(tr, done, state, ran)
      if (done % cfg.log_every == 0 or done == cfg.num_train_steps
          or done == start + 1):  # The first step shows the starting point.
        m = {k: v for k, v in jax.device_get(m).items()
             if k not in ("feature_counts", "heavy_rows_by_hot")}
        if not np.isfinite(m["loss"]):
          raise FloatingPointError(f"non-finite loss {m['loss']} at step "
                                   f"{done}")
        now = time.time()
        tps = tokens_since / max(now - t_last, 1e-9)
        t_last, tokens_since = now, 0
        m = dict(m, tokens_per_s=tps, params=n_params)
        peak = (jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
        if peak:
          m["peak_memory_gib"] = peak / 2**30
        if ran is not None:
          m["sparse_layers"] = sum(name != "dense" for name in ran[0])
          m["hot_features"] = np.asarray(ran[1])
        logging.info("%s", _log_line(done, m, tr.model_cfg.d_ff, tps, progress)
                     + ("" if ran is None else f" | ffn {choice.describe(ran)}"))
        last = metrics_lib.flatten_metrics(m)
        writer.write_scalars(done, last)
      if eval_data is not None and (done % cfg.eval_every == 0
                                    or done == cfg.num_train_steps):
        t_eval = time.time()
        ev = tr.evaluate(state["params"], eval_data)
        logging.info("eval step %d: %s", done, json.dumps(ev))
        writer.write_scalars(done, metrics_lib.flatten_metrics(
            {f"eval/{k}": v for k, v in ev.items()}))
        t_last += time.time() - t_eval  # Exclude eval time from tokens/s.
      final = done == cfg.num_train_steps
      stop = watch.stop_after(done)
      # checkpoint_every <= 0 disables saving (benchmarks).
      if cfg.checkpoint_every > 0 and (final or stop or mngr.should_save(done)):
        checkpointing.save(mngr, done, state,
                           {"processes": _all_process_states(data_state)},
                           _meta(cfg, done, running, pending), force=final or stop)
      if stop and not final:
        preempted = preemption.Preempted(done, saved=cfg.checkpoint_every > 0)
        break
    writer.flush()
  finally:
    tracer.stop()
    if steps is not None:
      steps.close()
    prefetch.close()
    checkpointing.finish(mngr)
    writer.close()
  if preempted is not None:
    raise preempted
  return last
