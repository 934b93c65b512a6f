"""The per-layer FFN choice in a training run: its compiled steps, built in the background and
switched on fixed steps.

`StepBuilds` compiles the train step of a choice (`LayerChoice.key`) on a worker thread.
`ChoiceSteps` runs the choice inside the loop: every `layer_choice.every` steps a decision
from the feature counts of the steps since the last one (`LayerChoice.update_from_counts`)
sorts each layer's features in the state and, when the choice changes and its build pays
(`payback`), asks for its step, which runs from the first step after its build is done (the
device never waits for it). Its step (`layer_choice.landing_steps` dense steps' time after the
decision, `landing_lag`: more steps when the running choice's steps are predicted faster) is
where a build starts counting late (`build_timeout_s`), and with `layer_choice.wait_for_builds`
the step it lands on, the loop waiting for its build there; without `layer_choice.background`
it is built at once and runs from the next step. While a choice is pending no other is
decided: each decision lands. The sparse kernels are compiled ahead, when the run starts, in
the steps `layer_choice.ahead` names (`_compile_kernels_ahead`), so that a choice's build is
mostly the XLA program around them; a choice equal to one of those steps lands at once, and with
`layer_choice.bridge` the one predicted fastest also runs from any decision that predicts it
faster than the running step until a choice lands (`_bridge`). What runs when follows from
the decisions, the predictions and step numbers alone: the same seed gives the same decisions
and switches on the same steps on any machine, and a checkpoint keeps the choice in use, the
one pending and the step from which the steps compiled ahead count as built (`meta`,
`_restore`). Several processes take the branches that hang on time (a build done or not)
together (`agreed`). The held-out evaluations during the run use a sparse choice's FFNs once
their evaluation step is compiled, beside training before the evaluation (`prepare_eval`,
`eval_key`).
"""

import concurrent.futures
import math
import os
import queue
import sys
import threading
import time
import traceback

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from train.models import layer_choice as layer_choice_lib
from train.runtime import compilation


def _child_processes() -> str:
  """This process's children as "name pid state" (Linux /proc; "" elsewhere). A compile that
  never returns may be waiting on a subprocess (ptxas) that has exited ("Z") or hung."""
  out = []
  try:
    for task in os.listdir("/proc/self/task"):
      with open(f"/proc/self/task/{task}/children") as f:
        for pid in f.read().split():
          with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read()
          name = fields[fields.index("(") + 1:fields.rindex(")")]
          out.append(f"{name} {pid} {fields[fields.rindex(')') + 2]}")
  except OSError:
    pass
  return ", ".join(out)


class BuildTimeout(Exception):
  """A build not done within the wait its caller allows (`StepBuilds.get`)."""


def agreed(flag: bool, *, every: bool) -> bool:
  """`flag` as all processes together see it: true on every one (`every`), else on any one.
  Where a branch depends on time (a build's end), several processes must still take the same
  one: each runs every step, and a step some would switch and others not would never meet in
  its collectives. Called by every process at the same step."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  flags = multihost_utils.process_allgather(np.int32(flag))
  return bool(flags.all() if every else flags.any())


class StepBuilds:
  """Compiled train steps per `LayerChoice.key`, built on a worker thread.

  `request(key)` starts building the step of `key` (tens of seconds at large shapes) while
  the current one keeps training; `get(key)` returns it, waiting for its build if it is not
  done (or building it in this thread if it was never requested). Which step runs from which
  step on is the caller's decision, from step numbers alone (`train.training.loop`: a choice made
  at step n runs from step n + `landing_lag` on), so a run's sequence of
  choices and the steps they land on do not depend on how fast a build goes. Executables are
  kept: going back to a choice built before costs nothing. `background=False` builds in
  `request`.

  Builds run inside `compilation.beside_training` (the training loop's dispatch does not wait
  behind their Python work).

  A build can fail to come back (XLA's compile has been seen never to return). `get` waits
  at most `timeout` seconds, then raises `BuildTimeout` with every thread's stack in the log;
  `busy()` stays true until that build ends. The worker is a daemon thread, so a build that
  never ends does not keep the process from exiting.
  """

  def __init__(self, build, background: bool = True):
    self._build = build
    self.background = background
    self._queue = queue.SimpleQueue()
    self._worker = None
    self._futures: dict[tuple, object] = {}
    self.build_s: dict[tuple, float] = {}   # seconds each build took
    self.overdue = None   # the key of a build that outlasted a `get` timeout, until it ends

  def _timed_build(self, key: tuple):
    t0 = time.perf_counter()
    step = self._build(key)
    self.build_s[key] = time.perf_counter() - t0
    logging.info("built the train step for %s in %.1f s", key, self.build_s[key])
    return step

  def _build_in_background(self, key: tuple):
    with compilation.beside_training():
      return self._timed_build(key)

  def _work(self) -> None:
    while True:
      item = self._queue.get()
      if item is None:
        return
      future, key = item
      if not future.set_running_or_notify_cancel():
        continue
      try:
        future.set_result(self._build_in_background(key))
      except BaseException as e:  # pylint: disable=broad-except  # raised by get()
        logging.warning("building the train step for %s failed (%s: %s); it is raised where "
                        "that step is taken", key, type(e).__name__, e)
        future.set_exception(e)

  def request(self, key: tuple) -> None:
    """Starts building the step of `key` unless it is built or being built."""
    if key in self._futures:
      return
    if self.background:
      self._futures[key] = concurrent.futures.Future()
      self._queue.put((self._futures[key], key))
      if self._worker is None:
        self._worker = threading.Thread(target=self._work, name="step-builds", daemon=True)
        self._worker.start()
    else:
      self.get(key)

  def adopt(self, key: tuple, future) -> None:
    """Takes `future` (a `concurrent.futures.Future` of the step of `key`, built elsewhere) as
    that key's build, unless one was asked for already."""
    self._futures.setdefault(key, future)

  def done(self, key: tuple) -> bool:
    """Whether the step of `key` is built (or its build failed)."""
    return key in self._futures and self._futures[key].done()

  def busy(self) -> bool:
    """Whether a build that outlasted a `get` timeout is still running."""
    if self.overdue is not None and self.done(self.overdue):
      self.overdue = None
    return self.overdue is not None

  def get(self, key: tuple, timeout: float | None = None):
    """The step of `key`, waiting for its build (an exception of the build is raised here), at
    most `timeout` seconds (then `BuildTimeout`)."""
    if key not in self._futures:
      done = concurrent.futures.Future()
      try:
        done.set_result(self._timed_build(key))
      except Exception as e:  # pylint: disable=broad-except  # raised by result() below
        done.set_exception(e)
      self._futures[key] = done
    try:
      return self._futures[key].result(timeout=timeout)
    except concurrent.futures.TimeoutError:
      self.overdue = key
      frames = sys._current_frames()  # pylint: disable=protected-access
      names = {t.ident: t.name for t in threading.enumerate()}
      stacks = "\n".join(f"thread {names.get(ident, ident)}:\n"
                         + "".join(traceback.format_stack(frame))
                         for ident, frame in frames.items())
      logging.error("the build of the train step for %s is not done after %.0f s; child "
                    "processes: %s; every thread's stack:\n%s", key, timeout,
                    _child_processes() or "none", stacks)
      raise BuildTimeout(f"not built after {timeout:.0f} s (every thread's stack is in the "
                         "log)") from None

  def close(self, timeout: float | None = None):
    """Cancels the builds that have not started and waits for the one in flight (at most
    `timeout` seconds: a build may never come back), unless it outlasted a `get` timeout."""
    for future in self._futures.values():
      future.cancel()
    if self._worker is not None:
      self._queue.put(None)
      if not self.busy():
        self._worker.join(timeout)


def payback(choice, running, counts, heavy, tokens: int, steps_left: int,
            ffn_share: float) -> str | None:
  """Why the choice's new step would not pay for its build (None: it would).

  Saving: the predicted FFN time of the running step and of the new one
  (`LayerChoice.costs`, over the dense FFN's), the FFN being `ffn_share` of a dense step,
  over the steps left, in dense steps. Cost: `layer_choice.BUILD_COST_STEPS`. Steps, not
  seconds, so that the decision is the same in every run of a seed. A layer the choice leaves
  as it runs saves nothing, also where its predicted time is infinite (rows over the ELL
  width past the last tail bucket, held for one decision by `LayerChoice.update_from_counts`)."""
  old = choice.costs(running, counts, tokens, heavy)
  new = choice.costs(choice.key, counts, tokens, heavy)
  kept = np.array([a == b for a, b in zip(zip(*running), zip(*choice.key))]) | (old == new)
  saving = ffn_share * float((old[~kept] - new[~kept]).sum() / old.shape[0]) * steps_left
  if saving > layer_choice_lib.BUILD_COST_STEPS:
    return None
  return (f"predicted to save {saving:.1f} dense steps' time over the {steps_left} steps "
          f"left, less than the {layer_choice_lib.BUILD_COST_STEPS:.0f} a build takes")


# With `layer_choice.landing_by_layers`, the fewest sparse layers a step's landing lag counts,
# as a fraction of the layers: the program around them takes its time too.
LANDING_LAYERS_FLOOR = 0.25


def landing_lag(choice, running, counts, heavy, tokens: int, dense_steps: int,
                ffn_share: float, by_layers: bool = False) -> int:
  """Steps from a decision to the step its choice runs from: `dense_steps` dense steps' time
  at the running choice's predicted speed (its FFN's predicted time over the dense FFN's,
  `LayerChoice.costs`, the FFN being `ffn_share` of a dense step), so that a build has about
  the same seconds to finish whatever runs meanwhile (sparse steps are shorter, so more of them
  fit). From predictions, not clocks: the same counts give the same lag on any machine.

  `by_layers` (`layer_choice.landing_by_layers`): `dense_steps` is the time for a step with
  every layer sparse, and a choice with fewer sparse layers gets that share of it (at least
  `LANDING_LAYERS_FLOOR`): its build compiles that many layers' kernel calls (at the paper
  shape on an H200 about 2 s a sparse layer: 4 layers 7.6-8.9 s, 7 or 8 layers 13.5-21.8 s)."""
  if dense_steps <= 0:
    return 0
  if by_layers:
    n = len(choice.key[0])
    sparse = sum(name != layer_choice_lib.DENSE for name in choice.key[0])
    dense_steps = dense_steps * max(sparse / n, LANDING_LAYERS_FLOOR)
  costs = np.minimum(choice.costs(running, counts, tokens, heavy), 1.5)
  step_ratio = min(1.0, max(0.3, 1.0 - ffn_share * (1.0 - float(costs.mean()))))
  return int(math.ceil(dense_steps / step_ratio))


class ChoiceSteps:
  """The per-layer choice of one run (module docstring): `step_for(step)` before each step,
  `after_step(done, metrics, state)` after it, `meta()` for its checkpoint."""

  def __init__(self, tr, choice, state, meta: dict, events=None, first_step=None):
    """`events(step, name, **fields)` records what the choice does (a `MetricWriter`'s
    `write_event`): "ffn_decision" (a choice decided: "choice", "predicted", "runs_from") and
    "ffn_landing" (a step starts running: "choice", "build_s", "waited_s", "late_steps",
    "note"). `first_step`: a future of the running choice's step, compiled elsewhere
    (`train.training.loop`: while the run opened)."""
    cfg = tr.cfg
    self._event = events or (lambda *a, **k: None)
    self.tr, self.choice, self.cfg = tr, choice, cfg
    # Compiled ahead of time for the state's and the batch's exact types (no retrace at a
    # switch), without autotuning on a GPU: builds run beside training, where autotuning
    # takes about 5x longer, and a resumed run must build each choice's step alike.
    like = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
    state_spec = jax.tree.map(like, state)
    batch_spec = tr.batch_spec()
    self.builds = StepBuilds(
        lambda key: tr.compile_train_step(key, state_spec, batch_spec, autotune=False),
        background=cfg.layer_choice.background)
    self.lag = cfg.layer_choice.landing_steps if cfg.layer_choice.background else 0
    self.lag_by_layers = bool(cfg.layer_choice.get("landing_by_layers", False))
    self.build_timeout_s = cfg.layer_choice.build_timeout_s
    self.wait_for_builds = bool(cfg.layer_choice.get("wait_for_builds", False))
    self.sparse_eval = (bool(cfg.layer_choice.get("sparse_eval", True))
                        and not self.wait_for_builds and self.builds.background)
    self._eval_keys = []   # the sparse choices whose evaluation step was asked for, in order
    self._late_since = None   # when a pending choice's landing step came before its build
    self.bridge = cfg.layer_choice.bridge
    self.pending = None   # (key, step): a choice decided, running from that step on
    # The feature counts and heavy rows summed over the steps since the last decision (device
    # arrays), and how many steps that is.
    self.counted, self.counted_steps = None, 0
    # (keys, step): the steps compiled ahead (`_compile_kernels_ahead`), counted as built from
    # that step on.
    self.ahead = None
    self.ahead_spec = cfg.layer_choice.get("ahead", "256")
    self._restore(meta)
    if first_step is not None:
      self.builds.adopt(self.running, first_step)
    self.train_step = self.builds.get(self.running)
    self._compile_kernels_ahead(int(meta.get("step", 0)), meta.get("ahead_ready_step"))
    mc = tr.model_cfg
    self.ffn_share = layer_choice_lib.ffn_flop_share(
        mc.d_model, mc.d_ff, mc.n_layers, mc.vocab_size, cfg.data.seq_len, mc.n_heads,
        mc.n_kv_heads, mc.ffn_gated)
    self.tokens_per_step = cfg.batch_size * cfg.data.seq_len
    logging.info("Per-layer FFN choice: dense until a layer's sparse FFN is predicted at "
                 "below %g of the dense one's time (train.models.layer_choice), then %s "
                 "(back above %g); decided every %d steps (features sorted by popularity), "
                 "each choice running %d dense steps' time after its decision",
                 choice.sparse_below,
                 choice.sparse_implementation, choice.dense_above, cfg.layer_choice.every,
                 self.lag)

  # With several processes, a choice built before its step is looked for every this many
  # steps (each look is a collective over the processes; one process looks every step).
  EARLY_CHECK_STEPS = 5

  # Steps before a held-out evaluation from which its sparse step compiles (`prepare_eval`):
  # at the paper shape a forward compiles in seconds, about 100 sparse steps.
  EVAL_LEAD_STEPS = 150

  # Sparse implementations whose kernels a step compiled ahead compiles for every later one.
  AHEAD_FOR = ("mosaic_gpu",)

  def _compile_kernels_ahead(self, start: int, ready_step=None) -> None:
    """Builds, in the background, the steps `layer_choice.ahead` names
    (`layer_choice.ahead_keys`; by default one: the first layer dense, every other one on the
    sparse kernels at K = 256) when neither the running step nor the pending one has a sparse
    layer (or a resumed run's checkpoint says the run has them: `ready_step`).

    The kernels are the same in every choice's step (the hot features reach them at run
    time) and a process compiles each once (`pallas_kernels._common.stable_kernel_ids`), so
    after the first of these builds a choice's step builds faster, the time `landing_steps`
    is set for. A choice equal to one of them lands at once once they count as built
    (`_ahead_built`: once built, or with `wait_for_builds` `landing_steps` dense steps after
    the run's start, the same step in every run of a seed and in a resumed run). The first
    layer stays dense in them: from initialisation the first layer's activity falls last,
    long after the others'. While the activity falls,
    K = 256 leaves more rows over the ELL width than the kernels' dense tail holds in most
    layers (an infinite prediction); a wider K ("1024") and the last layer dense (":last",
    the densest after the first) give steps that can run earlier.

    They run in place of a choice still building only with `layer_choice.bridge` (`_bridge`)."""
    choice = self.choice
    if (choice.sparse_implementation not in self.AHEAD_FOR or not self.builds.background
        or self.tr.model_cfg.interpret):
      return
    inflight = [self.running] + ([self.pending[0]] if self.pending is not None else [])
    sparse = choice.sparse_implementation
    if ready_step is None and any(name == sparse for key in inflight for name in key[0]):
      return
    keys = layer_choice_lib.ahead_keys(self.ahead_spec, choice.n_layers, choice.d_ff, sparse)
    if not keys:
      return
    ready = start + self.lag if ready_step is None else int(ready_step)
    self.ahead = (keys, ready)
    logging.info("compiling the sparse kernels ahead: building the step of %s (usable from "
                 "step %d)", " and of ".join(choice.describe(key) for key in keys), ready + 1)
    for key in keys:
      self.builds.request(key)

  def _ahead_built(self, done: int) -> tuple:
    """The keys of the steps compiled ahead that count as built after `done` steps: those
    built on every process, or with `layer_choice.wait_for_builds` all of them from the step
    they were given (`landing_steps` after the start: the same step in every run)."""
    if self.ahead is None:
      return ()
    if self.wait_for_builds:
      return self.ahead[0] if done >= self.ahead[1] else ()
    return tuple(k for k in self.ahead[0] if agreed(self.builds.done(k), every=True))

  # How much faster than the running step the step compiled ahead must be predicted to run
  # in the meantime: its FFN's time over the dense FFN's, mean over the layers.
  BRIDGE_GAIN = 0.05

  def _bridge(self, done: int, counts, heavy, tokens: int):
    """With `layer_choice.bridge`: the step compiled ahead predicted fastest, if it should run
    from the next step on (it counts as built, is neither running nor the choice just
    decided, and its FFN is expected `BRIDGE_GAIN` faster than the running step's, over the
    dense FFN's, mean over the layers, on this decision's counts), with both those means.
    Else None.

    Asked at every decision, a choice pending or not (`_run_bridge`): from initialisation the
    first choice is made at a high activity (a large K), and the layers' activity keeps
    falling while it builds, so the step compiled ahead can be the faster one meanwhile."""
    choice = self.choice
    built = [k for k in self._ahead_built(done) if k not in (self.running, choice.key)]
    if not self.bridge or not built:
      return None
    # Expected times, not the pessimistic ones a K is chosen by: a running layer with a
    # window of heavy rows (inf there, held by the choice's hysteresis) must not hand the
    # whole step to a slower one until the next landing.
    predicted = {k: choice.costs(k, counts, tokens, heavy, expected=True)
                 for k in [*built, self.running]}
    key = min(built, key=lambda k: float(predicted[k].mean()))
    ahead, running = predicted[key], predicted[self.running]
    if float(ahead.mean()) < float(running.mean()) - self.BRIDGE_GAIN:
      return key, float(ahead.mean()), float(running.mean())
    # While every layer runs dense, why the steps compiled ahead wait: the layers each is
    # predicted slow on (inf: more rows over its ELL width than the kernels' dense tail holds).
    if all(name == layer_choice_lib.DENSE for name in self.running[0]):
      text = lambda ratios: " ".join(f"{r:.2f}" for r in ratios)
      logging.info("step %d: the steps built ahead, predicted against %s running, not run: %s",
                   done, text(running), "; ".join(f"{choice.describe(k)}: {text(predicted[k])}"
                                                  for k in built))
    return None

  def _run_bridge(self, done: int, counts, heavy, tokens: int) -> None:
    """Runs the step compiled ahead from the next step on if `_bridge` says so: until a choice
    lands, or a later decision finds it no longer the faster one."""
    bridge = self._bridge(done, counts, heavy, tokens)
    if bridge is None:
      return
    key, ahead, running = bridge
    until = ("" if self.pending is None else
             f", until {self.choice.describe(self.pending[0])} lands")
    try:
      self._run(key, done, f", compiled ahead (predicted {ahead:.2f} of dense's FFN time, "
                f"{self.choice.describe(self.running)} {running:.2f}){until}")
    except Exception as e:  # pylint: disable=broad-except  # training goes on as it runs
      logging.exception("building the step compiled ahead failed (%s: %s); training goes on "
                        "with %s", type(e).__name__, e, self.choice.describe(self.running))
      self.ahead = None

  @property
  def dense_key(self):
    """Every layer on the dense FFN: the evaluation step compiled at the run's start."""
    return (layer_choice_lib.DENSE,) * self.choice.n_layers, (0,) * self.choice.n_layers

  def prepare_eval(self, done: int, params, batch) -> None:
    """Within `EVAL_LEAD_STEPS` steps of a held-out evaluation, compiles the evaluation step of
    the running choice, if it has a sparse layer and none was asked for yet, beside training
    (`Trainer.compile_eval_ahead`). With `layer_choice.sparse_eval` off, or with
    `wait_for_builds` (reproducible runs: which step an evaluation finds compiled depends on
    time), evaluations stay on the dense FFNs."""
    cfg = self.cfg
    if not self.sparse_eval or cfg.eval_every <= 0:
      return
    following = min((done // cfg.eval_every + 1) * cfg.eval_every, cfg.num_train_steps)
    key = self.running
    if (following - done > self.EVAL_LEAD_STEPS or key in self._eval_keys
        or all(name == layer_choice_lib.DENSE for name in key[0])):
      return
    self._eval_keys.append(key)   # the same on every process: from steps and choices alone
    self.tr.compile_eval_ahead(params, batch, key, autotune=False)

  def eval_key(self):
    """The FFNs of a held-out evaluation now: the latest sparse choice whose evaluation step
    is compiled on every process (each computes the dense FFN's function, exactly up to
    rounding, faster once sparse), else the dense FFNs. Called by every process at once."""
    for key in reversed(self._eval_keys):
      if agreed(self.tr.eval_compiled(key) is True, every=True):
        return key
    return self.dense_key

  def _restore(self, meta: dict) -> None:
    """The choice in use and the one pending of a checkpoint's metadata (`meta`)."""
    choice = self.choice
    saved = meta.get("layer_implementations")
    if saved is not None and len(saved) == choice.n_layers:
      choice.current = list(saved)
      choice.hot = list(meta.get("layer_hot_features") or [0] * choice.n_layers)
    self.running = choice.key
    if meta.get("pending_layer_choice"):
      p = meta["pending_layer_choice"]
      self.pending = ((tuple(p["implementations"]), tuple(p["hot_features"])), p["step"])
      self.builds.request(self.pending[0])
      choice.current, choice.hot = list(self.pending[0][0]), list(self.pending[0][1])
    votes = meta.get("layer_dense_votes")
    if votes is not None and len(votes) == choice.n_layers:
      choice.over = [bool(v) for v in votes]
    saved = meta.get("choice_counts")
    if saved:   # the counts of the steps since the last decision
      self.counted = (jnp.asarray(saved["feature_counts"], jnp.int32),
                      jnp.asarray(saved["heavy_rows_by_hot"], jnp.int32))
      self.counted_steps = int(saved["steps"])

  def meta(self) -> dict:
    """What a checkpoint keeps of the choice (`ChoiceSteps.__init__` reads it back)."""
    (names, hot), out = self.running, {}
    out["layer_implementations"], out["layer_hot_features"] = list(names), list(hot)
    out["layer_dense_votes"] = [bool(v) for v in self.choice.over]
    if self.ahead is not None:
      out["ahead_ready_step"] = int(self.ahead[1])
    if self.pending is not None:
      (names, hot), land = self.pending
      out["pending_layer_choice"] = {"implementations": list(names),
                                     "hot_features": list(hot), "step": int(land)}
    if self.counted_steps:
      counts, heavy = jax.device_get(self.counted)
      out["choice_counts"] = {"steps": self.counted_steps,
                              "feature_counts": np.asarray(counts).tolist(),
                              "heavy_rows_by_hot": np.asarray(heavy).tolist()}
    return out

  def step_for(self, step: int):
    """The train step that runs step `step` (0-based): a pending choice lands on the first
    step its build is done by (on every process; several processes check every
    `EARLY_CHECK_STEPS` steps before the step its decision names, `landing_lag`): the device
    never idles for a build, and a choice runs as soon as it can (a seed's runs can then
    switch on different steps). A build `build_timeout_s` later than that step is given up
    on, training going on with the running step. With `layer_choice.wait_for_builds` a choice
    lands on its step, the loop waiting for its build there (at most `build_timeout_s`): a
    seed's runs and a resumed run switch on the same steps."""
    if self.pending is None:
      return self.train_step
    key, land = self.pending
    timeout = self.build_timeout_s
    if step < land:
      # Built before its step, it runs at once: waiting for the step would only make the
      # switch the same in every run of a seed, which only `wait_for_builds` promises.
      if (self.wait_for_builds
          or (jax.process_count() > 1 and step % self.EARLY_CHECK_STEPS)
          or not agreed(self.builds.done(key), every=True)):
        return self.train_step
    elif not self.wait_for_builds and not agreed(self.builds.done(key), every=True):
      now = time.perf_counter()
      self._late_since = now if self._late_since is None else self._late_since
      if not agreed(now - self._late_since >= self.build_timeout_s, every=False):
        return self.train_step
      timeout = 0.0   # late for as long as a wait would have been: give up on it now
    self.pending, self._late_since = None, None
    try:
      self._run(key, step, late=step - land, timeout=timeout)
    except Exception as e:  # pylint: disable=broad-except  # training goes on as it runs
      logging.exception("building the train step for %s failed (%s: %s); training goes on "
                        "with %s", key, type(e).__name__, e, self.choice.describe(self.running))
      self.choice.current, self.choice.hot = list(self.running[0]), list(self.running[1])
    return self.train_step

  def _run(self, key, step: int, note: str = "", late: int = 0, timeout=None) -> None:
    """Runs the step of `key` from step `step` (0-based) on, waiting for its build if it is
    not done (at most `timeout`, default `build_timeout_s`), `late` steps after the step its
    decision named (before it where negative)."""
    t0 = time.perf_counter()
    ready = self.builds.done(key)
    try:
      step_fn, error = self.builds.get(
          key, timeout=self.build_timeout_s if timeout is None else timeout), None
    except Exception as e:  # pylint: disable=broad-except  # raised below, once all know
      step_fn, error = None, e
    if not agreed(error is None, every=True):
      raise error or BuildTimeout("built here but not on every process; the processes go on "
                                  "with the step they run")
    self.train_step = step_fn
    self.running = key
    # The device idles while the loop waits: a build slower than the landing lag (a busy
    # host) shows here.
    waited = 0.0 if ready else time.perf_counter() - t0
    build_s = self.builds.build_s.get(key, 0.0)
    after = (f"; {late} steps after its step, once built" if late > 0 else
             f"; {-late} steps before its step, once built" if late < 0 else "")
    logging.info("step %d: now running FFN per layer %s (built in %.1f s; waited %.1f s%s)%s",
                 step + 1, self.choice.describe(key), build_s, waited, after, note)
    self._event(step + 1, "ffn_landing", choice=self.choice.describe(key),
                build_s=round(build_s, 3), waited_s=round(waited, 3), late_steps=late,
                note=note.lstrip(", "))

  def after_step(self, done: int, metrics: dict, state):
    """A decision after steps `every`, 2 `every`, ... (and the first): the state with each
    layer's features sorted by the counts of the steps since the last decision, the choice
    pending if it changed.

    The counts are summed on the device over those steps (one batch's vary a lot, and
    decisions on one batch would flip a layer's K and send it dense and back); the sum so far
    is in each checkpoint (`meta`), so a resumed run decides on the same counts."""
    cfg, choice = self.cfg, self.choice
    counted = (metrics["feature_counts"], metrics["heavy_rows_by_hot"])
    if self.counted_steps:
      counted = jax.tree.map(jnp.add, self.counted, counted)
    self.counted, self.counted_steps = counted, self.counted_steps + 1
    if done % cfg.layer_choice.every and done != 1:
      return state
    if agreed(self.builds.busy(), every=False):
      # A build outlasted its landing (`StepBuilds.get`): it holds the only worker, so no
      # choice is decided until it ends; training goes on with the running step.
      self.counted, self.counted_steps = None, 0
      return state
    # Decisions fall on the same steps in a resumed run as in an uninterrupted one (the
    # choice in use and the one pending come back from the checkpoint), so both reorder the
    # features alike and switch on the same steps.
    counts, heavy = jax.device_get(self.counted)
    tokens = self.tokens_per_step * self.counted_steps
    self.counted, self.counted_steps = None, 0
    target = self.running if self.pending is None else self.pending[0]
    choice.current, choice.hot = list(target[0]), list(target[1])
    _, order = choice.update_from_counts(counts, tokens, heavy)
    state = self.tr.sort_features(state, order)
    if choice.key == target or self.pending is not None:
      # One decision in flight at a time: a pending choice lands on its step, never replaced
      # by a later decision (decisions every `every` steps, each landing `landing_steps`
      # later, would otherwise supersede one another and none would land while activity
      # moves); the next decision comes after it lands.
      choice.current, choice.hot = list(target[0]), list(target[1])
      self._run_bridge(done, counts, heavy, tokens)
      return state
    # The step compiled ahead, once it counts as built, runs from the next step: no build.
    built = choice.key in self._ahead_built(done)
    land = done if built else done + landing_lag(choice, target, counts, heavy, tokens,
                                                 self.lag, self.ffn_share, self.lag_by_layers)
    why_not = ("it would land after the run ends" if land >= cfg.num_train_steps else
               None if built else payback(choice, target, counts, heavy, tokens,
                                          cfg.num_train_steps - land, self.ffn_share))
    if why_not:
      logging.info("step %d: FFN per layer -> %s predicted, not built: %s", done,
                   choice.describe(), why_not)
      choice.current, choice.hot = list(target[0]), list(target[1])
    else:
      logging.info("step %d: FFN per layer -> %s (predicted %s), running from step %d",
                   done, choice.describe(), " ".join(f"{r:.2f}" for r in choice.predicted),
                   land + 1)
      self._event(done, "ffn_decision", choice=choice.describe(),
                  predicted=[round(float(r), 4) for r in choice.predicted], runs_from=land + 1)
      self.pending = (choice.key, land)
      self.builds.request(choice.key)
    self._run_bridge(done, counts, heavy, tokens)
    return state

  def close(self):
    # A choice still building past its landing step (or decided too late to land) may be in
    # flight at the end of the run: wait for it no longer than for a landing.
    self.builds.close(timeout=self.build_timeout_s)
