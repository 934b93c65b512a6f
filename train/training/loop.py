"""The training loop: data -> jitted step -> metrics, eval and checkpoints.

`train_and_evaluate(config, workdir)` trains `config.num_train_steps` steps.
If DIR/checkpoints holds a usable checkpoint it resumes from it (params,
optimizer state, step, RNG, dead-feature counters, data position and the per-layer
FFN choice), so rerunning the same command after a crash continues the same run: on one
machine the resumed run ends with bit-identical parameters, because every
step is a pure function of (state, batch) and the batch stream is restored
exactly. Each process reads its own share of the documents (`train.state.trainer`
lays out the devices).
"""

import json
import os
import time

from absl import logging
import jax
import numpy as np

from train import errors
from train.config import workdir as workdir_config
from train.data import pipeline as data_lib
from train.data import workers as workers_lib
from train.hf import init_state as hf_init
from train.models import implementations
from train.models import transformer as model_lib
from train.runtime import compilation
from train.runtime import mesh as mesh_lib
from train.state import checkpointing
from train.runtime import metrics as metrics_lib
from train.training import preemption
from train.training import choice_steps
from train.state import trainer as trainer_lib


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
    raise errors.CheckpointError(
        f"the checkpoint holds data positions of {len(states)} processes; "
        f"resume with that many processes (now {jax.process_count()})")
  return states[jax.process_index()]


def _log_line(step, m, d_ff, tokens_per_s, progress) -> str:
  act = np.asarray(m["active_per_token"])
  dead = np.asarray(m["dead_fraction"])
  return (f"{progress.eta_line(step)} | loss {float(m['loss']):.4f} "
          f"ce {float(m['cross_entropy']):.4f} "
          f"l1 {float(m['l1_term']):.3g}x{float(m['l1_coeff']):.2g} "
          f"lr {float(m['learning_rate']):.2e} "
          f"gnorm {float(m['grad_norm']):.3f} {tokens_per_s:,.0f} tok/s "
          f"data wait {100 * m.get('data_wait_fraction', 0.0):.1f}% | "
          f"active/token {' '.join(f'{a:.1f}' for a in act)} of {d_ff} "
          f"max/tile {' '.join(str(int(x)) for x in m['max_tile_nnz'])} "
          f"overflow {' '.join(str(int(x)) for x in m['overflow_rows'])} "
          f"dead {' '.join(f'{x:.2f}' for x in dead)}")


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


class _FirstStepClock:
  """Where the wall-clock of a run's first step goes, in one log line: waiting for its batch,
  dispatching it, the step on the device (its first run: the device loads the program's
  kernels and libraries), the per-layer choice's decision after it (the first decision reads
  the step's own counts). The loop reads the first step's results right after anyway, so
  waiting for them here costs nothing."""

  def __init__(self, step: int):
    self.step, self.marks = step, []

  def mark(self, step: int, what: str, outputs=None) -> None:
    if step == self.step and self.marks is not None:
      if outputs is not None:
        jax.block_until_ready(outputs)
      self.marks.append((what, time.perf_counter()))

  def log(self, step: int) -> None:
    if step == self.step and self.marks:
      parts = [f"{what} {t - t0:.2f} s"
               for (_, t0), (what, t) in zip(self.marks, self.marks[1:])]
      logging.info("step %d's wall-clock: %s", step + 1, ", ".join(parts))
      self.marks = None


def train_and_evaluate(cfg, workdir: str, *, accept_config_change: bool = False,
                       allow_fresh_start: bool = False, hooks=()) -> dict:
  """Trains (resuming if possible); returns the last logged metrics.

  Before anything is built the config is checked (`train.config.checks.check`) and, on a
  workdir with checkpoints, compared with the one it was trained with
  (`train.state.checkpointing.check_workdir`; `accept_config_change` accepts changes of the
  optimisation). `allow_fresh_start` lets a workdir whose checkpoints were all
  quarantined start over. A SIGTERM from here on stops training after the current
  step: the checkpoint of that step is written, then `preemption.Preempted` raised.
  `hooks`: callables hook(trainer, step, state, layer_key) run after every step (`step` steps
  done; `layer_key` the per-layer choice's key that step ran, or None), for measurements inside
  a run (`benchmarks.sweeps.activity_sweep`); they must not change the state.
  """
  watch = preemption.Watch().install()
  try:
    return _train_and_evaluate(cfg, workdir, watch, accept_config_change=accept_config_change,
                               allow_fresh_start=allow_fresh_start, hooks=hooks)
  finally:
    watch.remove()


def _fresh_state_ahead(tr, cfg, workdir: str):
  """The fresh state of a run with no checkpoint, made on a worker thread (a future) while the
  data opens on the host: seconds each at the paper shape (its compile and the device's
  initialisation; the corpus's documents and the held-out batches). None where the state comes
  later as before: a workdir with checkpoints (the restore decides), or several processes,
  which must dispatch the same programs in the same order."""
  if jax.process_count() > 1 or checkpointing.steps_on_disk(workdir):
    return None
  return compilation.on_worker_thread(lambda: tr.new_state(jax.random.key(cfg.seed)))


def _first_step_ahead(tr, cfg):
  """The first train step compiled on a worker thread (a future of a `jax.stages.Compiled`)
  while the data opens and the fresh state is made, as it would compile at that step:
  autotuned for the model's own FFNs; for the per-layer choice, its first choice (every layer
  dense) without autotuning, like its every build (`choice_steps.StepBuilds`). Seconds at the
  paper shape that the first step no longer waits for. Called where `_fresh_state_ahead`
  makes the state."""
  choice = implementations.layer_choice(cfg, tr.model_cfg, tr.mesh.size)
  key = None if choice is None else choice.key
  state_spec, batch_spec = tr.abstract_state(), tr.batch_spec()

  took = {}   # the compile's seconds, logged by the loop once it takes the step

  def build():
    t0 = time.perf_counter()
    step = tr.compile_train_step(key, state_spec, batch_spec, autotune=choice is None)
    took["s"] = time.perf_counter() - t0
    return step

  first = compilation.on_worker_thread(build)
  first.took = took
  return first


def _prepare(cfg, workdir: str, *, accept_config_change: bool, allow_fresh_start: bool):
  """(config, Trainer, checkpoint manager, restored checkpoint or None, packer, first step,
  state, held-out batches, the first train step compiling or None) of a run: the config
  checked against the workdir's, the checkpoint restored or a fresh state made (from a
  Hugging Face checkpoint if the config names one)."""
  os.makedirs(workdir, exist_ok=True)
  compilation.use_compilation_cache(cfg.get("compilation_cache_dir"))
  hf_dir = (cfg.get("init_from_hf") or {}).get("path")
  if hf_dir:  # shapes and tokenizer of a Hugging Face checkpoint
    cfg = hf_init.configure(cfg, workdir)
  tr = trainer_lib.Trainer(cfg)
  logging.info("Devices: %s; model %s", jax.devices(), tr.model_cfg)
  data_lib.import_before_threads(cfg.data)
  fresh = _fresh_state_ahead(tr, cfg, workdir)
  first_step = _first_step_ahead(tr, cfg) if fresh else None
  # The data opens (local files are checked, the held-out batches made) before the workdir
  # records anything.
  source = data_lib.make_source(cfg.data, cfg.data.train_split)
  eval_data = tr.eval_batches() if cfg.eval_every > 0 else None
  changed = checkpointing.check_workdir(workdir, cfg.to_dict(), accept=accept_config_change)
  for path, old, new in changed["free"] + changed["acceptable"]:
    logging.warning("Config change on resume: %s: %r -> %r", path, old, new)
  logging.info("%s", mesh_lib.describe(tr.mesh, tr.state_sharding["params"],
                                           tr.grad_sharding))
  mngr, restored = checkpointing.restore_latest(
      workdir, tr.abstract_state(), every_steps=cfg.checkpoint_every,
      keep=cfg.keep_checkpoints, allow_fresh_start=allow_fresh_start)
  if jax.process_index() == 0:  # The config of the run from here on (for the next resume).
    workdir_config.write_workdir_config(workdir, cfg.to_dict())
  packer = data_lib.PackedBatches(
      source, tr.tokenizer,
      seq_len=cfg.data.seq_len, rows=cfg.batch_size // jax.process_count(), seed=cfg.seed,
      shard_index=jax.process_index(), shard_count=jax.process_count(),
      workers=workers_lib.auto_count(cfg.data))
  if restored is None:
    start = 0
    state = fresh.result() if fresh else tr.new_state(jax.random.key(cfg.seed))
    if hf_dir:
      state = hf_init.initial_state(tr, state, hf_dir)
  else:
    start, state = restored["step"], restored["state"]
    packer.set_state(_my_data_state(restored["data"]))
    logging.info("Resumed from checkpoint step %d", start)
  if restored is not None:
    first_step = None   # a checkpoint's state: its step compiles as it always has
  return cfg, tr, mngr, restored, packer, start, state, eval_data, first_step


def _step_metrics(m, n_params: int, ran) -> dict:
  """A logged step's metrics on the host: the step's scalars and per-layer values, the peak
  device memory and the per-layer choice that ran (`ran`, or None)."""
  m = {k: v for k, v in jax.device_get(m).items()
       if k not in ("feature_counts", "heavy_rows_by_hot")}
  m = dict(m, params=n_params)
  peak = (jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
  if peak:
    m["peak_memory_gib"] = peak / 2**30
  if ran is not None:
    m["sparse_layers"] = sum(name != "dense" for name in ran[0])
    m["hot_features"] = np.asarray(ran[1])
  return m


class _Window:
  """The tokens trained and the time spent waiting for data since the last logged step.

  The step logged is the step done, not dispatched (the host runs steps ahead of the device):
  the clock reads once its metrics are on the host (read after block_until_ready, a window
  that ended without a layer-choice decision, which syncs, measured short and the next one as
  much long). Evaluations are taken out (`start` moves on by their time)."""

  def __init__(self):
    self.start, self.tokens, self.data_wait = time.time(), 0, 0.0

  def read(self) -> dict:
    """tokens/s and the data-wait fraction of the window; starts the next one."""
    now = time.time()
    span = max(now - self.start, 1e-9)
    out = {"tokens_per_s": self.tokens / span, "data_wait_fraction": self.data_wait / span}
    self.start, self.tokens, self.data_wait = now, 0, 0.0
    return out


def _evaluate(tr, writer, done: int, params, eval_data, eval_key, note: str = "") -> float:
  """A held-out evaluation after `done` steps, logged (with `note`) and recorded; returns its
  seconds."""
  t_eval = time.time()
  ev = tr.evaluate(params, eval_data, eval_key)
  writer.write_event(done, "eval_batch_losses", losses=ev.pop("batch_losses"))
  logging.info("eval step %d%s: %s", done, note, json.dumps(ev))
  writer.write_scalars(done, metrics_lib.flatten_metrics(
      {f"eval/{k}": v for k, v in ev.items()}))
  return time.time() - t_eval


def _train_and_evaluate(cfg, workdir: str, watch: preemption.Watch, *,
                        accept_config_change: bool, allow_fresh_start: bool, hooks) -> dict:
  cfg, tr, mngr, restored, packer, start, state, eval_data, first_step = _prepare(
      cfg, workdir, accept_config_change=accept_config_change,
      allow_fresh_start=allow_fresh_start)
  is_main = jax.process_index() == 0
  n_params = model_lib.count_params(state["params"])
  logging.info("Parameters: %s; FFN implementation: %s", f"{n_params:,}",
               implementations.training(cfg, tr.model_cfg, tr.mesh.size).describe())
  writer = metrics_lib.MetricWriter(workdir, enabled=is_main)
  if start == 0 and is_main:
    writer.write_text(0, "config", "```\n" + str(cfg) + "\n```")
  prefetch = data_lib.Prefetcher(packer, depth=cfg.data.prefetch)
  progress = metrics_lib.Progress(cfg.num_train_steps, start)
  shape = (cfg.grad_accum_steps, cfg.batch_size // jax.process_count() // cfg.grad_accum_steps,
           cfg.data.seq_len + 1)
  choice = implementations.layer_choice(cfg, tr.model_cfg, tr.mesh.size)
  steps = None if choice is None else choice_steps.ChoiceSteps(
      tr, choice, state, (restored or {}).get("meta") or {}, events=writer.write_event,
      first_step=first_step)
  train_step = None
  if steps is None:
    train_step = first_step.result() if first_step else tr.jit_train_step()
  if first_step is not None:   # taken (the choice's builds wait for it)
    logging.info("compiled the first train step in %.1f s, while the data opened",
                 first_step.took["s"])
  last, preempted, window = {}, None, _Window()
  tracer, clock = _StepTracer(cfg.get("profile"), workdir), _FirstStepClock(start)
  try:
    for step in range(start, cfg.num_train_steps):
      if steps is not None:
        train_step = steps.step_for(step)
      ran = None if steps is None else steps.running
      t_wait = time.perf_counter()
      clock.mark(step, "")
      batch, data_state = next(prefetch)
      window.data_wait += time.perf_counter() - t_wait
      clock.mark(step, "data")
      tracer.before(step)
      with jax.profiler.StepTraceAnnotation("train", step_num=step):
        state, m = train_step(state, tr.put_batch(batch.reshape(shape).astype(np.int32),
                                                  tr.batch_sharding))
      clock.mark(step, "dispatch")
      clock.mark(step, "on the device", outputs=m)
      done = step + 1
      tracer.after(done, m)
      window.tokens += cfg.batch_size * cfg.data.seq_len
      if steps is not None:
        state = steps.after_step(done, m, state)
        clock.mark(step, "decision")
      for hook in hooks:
        hook(tr, done, state, ran)
      if done % cfg.log_every == 0 or done == cfg.num_train_steps or done == start + 1:
        m = _step_metrics(m, n_params, ran)
        m.update(window.read(), data_passes=packer.passes(data_state))   # this process's docs
        if not np.isfinite(m["loss"]):
          raise FloatingPointError(f"non-finite loss {m['loss']} at step {done}")
        logging.info("%s", _log_line(done, m, tr.model_cfg.d_ff, m["tokens_per_s"], progress)
                     + ("" if ran is None else f" | ffn {choice.describe(ran)}"))
        last = metrics_lib.flatten_metrics(m)
        writer.write_scalars(done, last)
      clock.log(step)
      if done == start + 1 and eval_data:
        # Beside the next steps, not beside the first one's compile.
        tr.compile_eval_ahead(state["params"], eval_data[0],
                              None if steps is None else steps.dense_key)
      if steps is not None and eval_data:
        steps.prepare_eval(done, state["params"], eval_data[0])
      if eval_data is not None and (done % cfg.eval_every == 0
                                    or done == cfg.num_train_steps):
        key = None if steps is None else steps.eval_key()
        window.start += _evaluate(tr, writer, done, state["params"], eval_data, key,
                                  "" if steps is None else f" (FFN per layer "
                                  f"{choice.describe(key)})")
      final, stop = done == cfg.num_train_steps, watch.stop_after(done)
      # checkpoint_every <= 0 disables saving (benchmarks).
      if cfg.checkpoint_every > 0 and (final or stop or mngr.should_save(done)):
        checkpointing.save(mngr, done, state, {"processes": _all_process_states(data_state)},
                           checkpointing.meta(cfg, done, None if steps is None else steps.meta()),
                           force=final or stop)
      if stop and not final:
        preempted = preemption.Preempted(done, saved=cfg.checkpoint_every > 0)
        break
    writer.flush()
  finally:
    closing = {"trace": tracer.stop}
    if steps is not None:
      closing["builds"] = steps.close
    closing.update(data=prefetch.close, checkpoints=lambda: checkpointing.finish(mngr),
                   metrics=writer.close)
    took = {}
    for part, close in closing.items():
      t0 = time.perf_counter()
      close()
      took[part] = time.perf_counter() - t0
    # What a run's end waits for (a build in flight, the last checkpoint's write).
    logging.info("closed the run in %.1f s (%s)", sum(took.values()),
                 ", ".join(f"{k} {v:.1f} s" for k, v in took.items()))
  if preempted is not None:
    raise preempted
  return last
