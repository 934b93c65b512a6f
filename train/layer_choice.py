"""Per-layer choice of the FFN implementation and of its hot features while sparsity emerges.

From random initialisation a ReLU layer fires on about half of its features, where the
sparse kernels are slower than dense; L1 training brings it down over the first steps, at
different speeds per layer. `LayerChoice` keeps each layer on the dense FFN until its sparse
FFN's predicted time falls below `sparse_below` of the dense one's, and sends it back only
above `dense_above` (hysteresis: no flapping around one threshold).

The prediction (`CostModel`) is linear in what the sparse kernels do: a fixed part (the gate
GEMM, which stays dense, and the packing), the hot features K computed as dense GEMM columns
(`twell_jax.hot_feature_count`), and the entries outside them, gathered per token:

    ratio = fixed + hot * K / H + tail * tail_entries_per_token / (H * BREAK_EVEN_RATE)

Its coefficients are fitted to the kernel benchmark (`benchmarks.kernels`, H100, paper shape
M=16384, D=2048, H=5632, ratio to XLA dense in one process;
`benchmarks/results/h100/kernels_hot_block_*.json`): all activity on K = 1024, 2048
and 3328 features with no tail (`paper_16k_block<K>`: forward + backward 0.53, 0.75, 0.98;
forward 0.57, 0.80, 0.84) and 30.6 uniform entries per token with K = 0 (`paper_16k`: 0.73;
0.88). The captured layers (`benchmarks.captured`: forward + backward 0.46-0.57 with K of
256-768 and a few tail entries) land within 0.07 of it. Real L1-trained layers hold 90-99% of
their activity in a few hundred hot features, so a layer with 60-100 active per token is
predicted at 0.45-0.6 in training.

The coefficients hold at the paper shape. At another shape (D, H, M tokens per device) the
prediction is scaled by the kernels' measured speed there relative to the paper shape
(`twell_jax.shape_costs.shape_factor`), and at a shape where the kernels measured slower than
dense (`twell_jax.shape_costs.sparse_loses`: D <= 960 on an H100 today) no layer runs sparse.

With `update_from_counts`, each decision also picks every layer's K: a multiple of 256 that
minimizes the prediction (a hot column is worth `CostModel.break_even` of the tokens), with
hysteresis (a new K is taken when it improves the prediction by more than `HOT_CHANGE_GAIN`),
and gives the popularity order of the features, which the trainer applies to the parameters
(`train.model.permute_ffn_features`) so that the first K features are the hottest. Decisions
run on the host, every `every` steps, from the step metrics; a step is recompiled only when
an implementation or a sparse layer's K changes (a few times per run), and no conditional
runs on the device. The reference implementation switches at 50 active features per token
every 20 forward calls.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time

from absl import logging

import numpy as np

from twell_jax import features as features_lib
from twell_jax import shape_costs



@dataclasses.dataclass(frozen=True)
class CostModel:
  """A sparse FFN layer's time over the dense one's, predicted (module docstring)."""
  fixed: float
  hot: float     # per hot fraction K / H
  tail: float    # per tail entries per token over H * BREAK_EVEN_RATE

  def ratio(self, d_ff: int, hot_features, tail_per_token):
    return (self.fixed + self.hot * np.asarray(hot_features, np.float64) / d_ff
            + self.tail * np.asarray(tail_per_token, np.float64)
            / (d_ff * features_lib.BREAK_EVEN_RATE))

  @property
  def break_even(self) -> float:
    """The firing rate above which a feature is cheaper as a hot (dense) column."""
    return features_lib.BREAK_EVEN_RATE * self.hot / self.tail


# Fitted to the H100 kernel benchmark (module docstring).
TRAINING_COST = CostModel(fixed=0.33, hot=1.10, tail=0.74)     # forward + backward
INFERENCE_COST = CostModel(fixed=0.50, hot=0.64, tail=0.70)    # forward
# Thresholds on the predicted ratio.
DEFAULT_SPARSE_BELOW = 0.9
DEFAULT_DENSE_ABOVE = 1.0
INFERENCE_SPARSE_BELOW = 0.9
# A new number of hot features is taken when it improves the predicted ratio by more than
# this: a smaller gain is not worth a recompiled step.
HOT_CHANGE_GAIN = 0.03
# The training loop's time lost per second of a background build, as measured in the
# trainer: paper 0.5B shape, H100, 16 CPU cores, 100 steps took 21 s beside ~34 s of builds
# against 14 s without (`benchmarks.quality` logs). A plain loop beside a build
# (`benchmarks.probes.background_build`) loses nothing, so this also holds the cost of the
# quick, untuned steps that run meanwhile.
BUILD_SLOWDOWN = 0.4


def ffn_flop_share(d_model: int, d_ff: int, n_layers: int, vocab_size: int, seq_len: int,
                   n_heads: int, n_kv_heads: int, gated: bool = True) -> float:
  """The dense FFN's share of a dense training step's matmul FLOPs (per token: the FFN's
  (2 or 3) x D x H per layer against attention's projections and scores and the LM head)."""
  head = d_model // n_heads
  ffn = (3 if gated else 2) * d_model * d_ff * n_layers
  attn = (2 * d_model * d_model + 2 * d_model * n_kv_heads * head + seq_len * d_model) * n_layers
  return ffn / (ffn + attn + vocab_size * d_model)


@dataclasses.dataclass
class LayerChoice:
  """Per-layer FFN implementation and hot features with hysteresis (module docstring)."""
  n_layers: int
  d_ff: int
  sparse: str = "mosaic_gpu"
  dense: str = "dense"
  sparse_below: float = DEFAULT_SPARSE_BELOW
  dense_above: float = DEFAULT_DENSE_ABOVE
  cost: CostModel = TRAINING_COST
  current: list[str] | None = None
  hot: list[int] | None = None
  # The layers' shape: D and the tokens of one FFN call (per device), for the mosaic_gpu
  # kernels' measured speed there. None: the paper shape, where the cost model was fitted (also
  # what to pass for the interpreter, which runs for correctness, not speed).
  d_model: int | None = None
  tokens: int | None = None

  def __post_init__(self):
    if not 0 <= self.sparse_below <= self.dense_above:
      raise ValueError(f"need 0 <= sparse_below ({self.sparse_below}) <= dense_above "
                       f"({self.dense_above})")
    if self.d_ff <= 0:
      raise ValueError(f"d_ff must be positive; got {self.d_ff}")
    if self.current is None:
      self.current = [self.dense] * self.n_layers
    if self.hot is None:
      self.hot = [0] * self.n_layers
    mode = "fwd" if self.cost is INFERENCE_COST else "fwd_bwd"
    if self.d_model is None or self.sparse != "mosaic_gpu":
      self.shape_scale, self.shape_loses = 1.0, False
    else:
      self.shape_scale = shape_costs.shape_factor(self.d_model, self.d_ff, self.tokens, mode)
      self.shape_loses = shape_costs.sparse_loses(self.d_model, self.d_ff, self.tokens)
    # The last update_from_counts: per layer, active features per token outside the hot
    # ones, and the predicted ratio.
    self.tail = None
    self.predicted = None

  def predict(self, hot_features, tail_per_token):
    """The predicted ratio of a layer at this choice's shape (inf where the kernels lose)."""
    if self.shape_loses:
      return np.full(np.shape(tail_per_token), np.inf)
    return self.cost.ratio(self.d_ff, hot_features, tail_per_token) * self.shape_scale

  @classmethod
  def for_inference(cls, tail_per_token, d_ff: int, hot_features=None,
                    sparse: str = "mosaic_gpu", d_model: int | None = None,
                    tokens: int | None = None) -> "LayerChoice":
    """The per-layer choice for a forward-only model with fixed weights: sparse where the
    forward's predicted ratio (`INFERENCE_COST`, at the shape d_model x d_ff with `tokens`
    per call) is below `INFERENCE_SPARSE_BELOW` (one decision, no hysteresis).
    `tail_per_token` [L]: each layer's active features per token outside its `hot_features`
    [L] (default none: the active features per token)."""
    tail = np.asarray(tail_per_token, np.float64).reshape(-1)
    hot = np.zeros_like(tail) if hot_features is None else np.asarray(hot_features)
    choice = cls(tail.shape[0], d_ff, sparse=sparse, sparse_below=INFERENCE_SPARSE_BELOW,
                 dense_above=INFERENCE_SPARSE_BELOW, cost=INFERENCE_COST, d_model=d_model,
                 tokens=tokens)
    choice.update(choice.predict(hot, tail))
    return choice

  def update(self, ratios) -> bool:
    """Applies one decision from the layers' predicted ratios (`predict`); True if any
    layer changed."""
    ratios = np.asarray(ratios, np.float64).reshape(-1)
    if ratios.shape[0] != self.n_layers:
      raise ValueError(f"got {ratios.shape[0]} layers' activity for {self.n_layers} layers")
    new = list(self.current)
    for l, r in enumerate(ratios):
      if new[l] == self.dense and r < self.sparse_below:
        new[l] = self.sparse
      elif new[l] == self.sparse and r > self.dense_above:
        new[l] = self.dense
    changed = new != self.current
    self.current = new
    return changed

  def update_from_counts(self, feature_counts, tokens: int):
    """One decision from each layer's feature counts [L, H] over `tokens` tokens
    (`FFNStats.feature_counts`): the hot features per layer (with hysteresis), then the
    implementations from the predicted ratios with them. Returns (changed, popularity order
    [L, H]: the permutation that sorts each layer's features hottest first)."""
    counts = np.asarray(feature_counts)
    if counts.shape[0] != self.n_layers:
      raise ValueError(f"got {counts.shape[0]} layers' counts for {self.n_layers} layers")
    if counts.shape[-1] != self.d_ff:
      raise ValueError(f"got counts of {counts.shape[-1]} features for d_ff={self.d_ff}")

    tail_of = lambda c, k: features_lib.sparse_work(c, tokens, k, break_even=0.0)
    hot, tails, ratios = list(self.hot), [], []
    for l, c in enumerate(counts):
      k = features_lib.hot_feature_count(c, tokens, break_even=self.cost.break_even)
      kept = tail_of(c, hot[l])
      if k != hot[l] and not self.shape_loses:   # no K makes a losing shape win
        new = tail_of(c, k)
        gain = float(self.predict(hot[l], kept) - self.predict(k, new))
        if gain > HOT_CHANGE_GAIN:
          hot[l], kept = k, new
      tails.append(kept)
      # Every feature hot: the dense FFN is that computation without the sparse overhead.
      ratios.append(np.inf if hot[l] >= c.shape[0] else float(self.predict(hot[l], kept)))
    changed = hot != self.hot
    self.hot, self.tail, self.predicted = hot, tails, ratios
    changed = self.update(ratios) or changed
    return changed, np.asarray(features_lib.popularity_order(counts))

  def costs(self, key, feature_counts, tokens: int) -> np.ndarray:
    """Each layer's predicted FFN time over the dense FFN's at `key` ((implementations, hot
    features), `LayerChoice.key`) for the activity in `feature_counts` [L, H] (features in
    popularity order): 1 on a dense layer."""
    out = []
    for name, k, c in zip(*key, np.asarray(feature_counts)):
      if name != self.sparse:
        out.append(1.0)
      else:
        tail = features_lib.sparse_work(c, tokens, k, break_even=0.0)
        out.append(float(self.predict(k, tail)))
    return np.asarray(out)

  @property
  def implementations(self) -> tuple[str, ...]:
    return tuple(self.current)

  @property
  def hot_features(self) -> tuple[int, ...]:
    """Each layer's hot features (0 on dense layers, where they mean nothing)."""
    return tuple(k if name == self.sparse else 0 for name, k in zip(self.current, self.hot))

  @property
  def key(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(implementations, hot features): what a compiled step depends on."""
    return self.implementations, self.hot_features

  def describe(self, key=None) -> str:
    """'S' for a sparse layer (with its hot features, 'S512'), 'D' for a dense one, in layer
    order (of `key`, default the current choice), space-separated."""
    names, hot = key or self.key
    return " ".join(("S" + (str(k) if k else "")) if name == self.sparse else "D"
                    for name, k in zip(names, hot))


class BackgroundSteps:
  """Compiled train steps per `LayerChoice.key`, compiled on a worker thread.

  `build(names, autotune)` compiles the step for `names`; `autotune=False` is a quicker build
  of a slower step (`train.train_lib.NO_AUTOTUNE`).

  A switch must not stall training: the new step compiles (tens of seconds at the paper's
  shape) while the current one keeps running, and `ready` hands over the newest requested
  step that is built (a request that arrives while another builds replaces the queued one;
  the one in flight is still handed over when done, being closer to the latest choice than
  the step running). Executables are kept, so switching back costs nothing. A request may
  carry a deadline (`time.monotonic()` by which the run ends): a queued build that would
  finish after it, at the last build's pace, is not started (the run would only wait for it
  at `close`).
  `background=False` builds in `request` (the switch lands on the decision step:
  reproducible).

  With `quick_first`, a background build is two: without autotuning first, so that the switch
  lands soon, then with it, handed over as an upgrade of the same choice unless a newer
  request is waiting. At the paper's shape on an H100, autotuning on a device that the
  training loop keeps busy makes a build about 5x longer (25 s against 120 s cold), and the
  step it gives is about 2.5% faster (`benchmarks.probes.background_build`).

  Tracing and lowering are Python work that holds the GIL, and the training loop must not wait
  behind it to dispatch its steps (the device would idle). While a build runs, the
  interpreter's switch interval is shortened and the cyclic garbage collector is off: its
  full collections over the objects a build creates stop every thread for 100-200 ms each,
  three or four per build at the paper's shape.
  """

  _BUILD_SWITCH_INTERVAL_S = 2e-4
  TUNE_PAYS_AFTER_BUILDS = 80   # 0.025 x left > BUILD_SLOWDOWN x 5 x quick build

  def __init__(self, build, background: bool = True, quick_first: bool = False):
    import concurrent.futures  # pylint: disable=import-outside-toplevel
    import threading  # pylint: disable=import-outside-toplevel
    self._build = build
    self.background = background
    self._quick_first = quick_first
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    self._lock = threading.Lock()
    self._done: dict[tuple, object] = {}
    self._tuned: set[tuple] = set()  # names whose kept step was built with autotuning
    self._seq = 0                    # requests so far
    # ((request number, 0 quick / 1 tuned), names) of the newest build of the newest request.
    self._newest_built = ((0, 0), None)
    self._handed = (0, 0)            # the version handed over last
    self._queued = []
    self._deadline = None            # the latest request's (time.monotonic())
    self._closing = False
    self.last_build_s = None         # seconds the last build took
    self.failures = []               # (names, exception) of background builds that failed

  def get_now(self, names: tuple):
    """The step for `names`, compiled in this thread if it is not built yet."""
    if names not in self._done:
      self._done[names] = self._timed_build(names, True)
      self._tuned.add(names)
    return self._done[names]

  def _built(self, seq: int, names: tuple, step, tuned: bool) -> None:
    with self._lock:
      self._done[names] = step
      if tuned:
        self._tuned.add(names)
      version = (seq, int(tuned))
      if version > self._newest_built[0]:
        self._newest_built = (version, names)

  def _timed_build(self, names: tuple, autotune: bool):
    t0 = time.perf_counter()
    step = self._build(names, autotune)
    self.last_build_s = time.perf_counter() - t0
    logging.info("built the train step for %s in %.1f s%s", names, self.last_build_s,
                 "" if autotune else " (not autotuned)")
    return step

  def _build_in_background(self, seq: int, names: tuple) -> None:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, self._BUILD_SWITCH_INTERVAL_S))
    collecting = gc.isenabled()
    gc.disable()
    try:
      if self._would_miss_deadline():
        logging.info("not building the train step for %s: the run ends in %.0f s, the last "
                     "build took %.0f s", names, self._deadline - time.monotonic(),
                     self.last_build_s)
        return
      if names not in self._done:
        logging.info("building the train step for %s in the background", names)
        autotune = not self._quick_first
        self._built(seq, names, self._timed_build(names, autotune), autotune)
      if (names not in self._tuned and self._seq == seq and not self._closing
          and self._tuning_pays()):
        # Nothing newer waits: the tuned step, handed over in place of the quick one.
        self._built(seq, names, self._timed_build(names, True), True)
    except Exception as e:  # pylint: disable=broad-except
      # Training goes on with the step it runs; the failure must not pass unseen (a
      # worker thread's exception is otherwise kept in its future, which nobody reads).
      self.failures.append((names, e))
      logging.exception("building the train step for %s failed (%s: %s); training goes on "
                        "with the current one", names, type(e).__name__, e)
    finally:
      if collecting:
        gc.enable()
      sys.setswitchinterval(interval)

  def _tuning_pays(self) -> bool:
    """Whether the tuned stage of a quick build pays before the deadline: its step is ~2.5%
    faster, and its build takes ~5x the quick one's on a busy device, costing the loop
    `BUILD_SLOWDOWN` of that: it pays with more than `TUNE_PAYS_AFTER_BUILDS` quick builds'
    time left."""
    return (self._deadline is None or self.last_build_s is None
            or self._deadline - time.monotonic()
            > self.TUNE_PAYS_AFTER_BUILDS * self.last_build_s)

  def _would_miss_deadline(self) -> bool:
    return (self._deadline is not None and self.last_build_s is not None
            and time.monotonic() + self.last_build_s > self._deadline)

  def request(self, names: tuple, deadline: float | None = None) -> None:
    """Asks for the step of `names` (built in the background unless built before); a
    background build does not start after `deadline` (`time.monotonic()`) minus the last
    build's time."""
    self._seq += 1
    self._deadline = deadline
    if names in self._done:
      self._built(self._seq, names, self._done[names], names in self._tuned)
      if names in self._tuned or not self.background:
        return
    if self.background:
      for future in self._queued:
        future.cancel()                # not started yet: superseded
      self._queued = [self._pool.submit(self._build_in_background, self._seq, names)]
    else:
      self._built(self._seq, names, self._timed_build(names, True), True)

  def ready(self):
    """(names, step) of the newest built request not handed over yet, else None."""
    with self._lock:
      version, names = self._newest_built
      if version <= self._handed:
        return None
      self._handed = version
      return names, self._done[names]

  def close(self):
    """Cancels what has not started and waits for the build in flight (the tuned stage of a
    quick one is skipped)."""
    self._closing = True
    for future in self._queued:
      future.cancel()
    self._pool.shutdown(wait=True)
