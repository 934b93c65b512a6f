"""Per-layer choice of the FFN implementation and of its hot features while sparsity emerges.

From random initialisation a ReLU layer fires on about half of its features, where the
sparse kernels are slower than dense; L1 training brings it down over the first steps, at
different speeds per layer. `LayerChoice` keeps each layer on the dense FFN until the work its
sparse kernels would do falls below `sparse_below` of the dense FFN's, and sends it back only
above `dense_above` (hysteresis: no flapping around one threshold). The work is measured in
features gathered per token (`twell_jax.features.sparse_work`): the active features per
token, except that the layer's hot features (those that fire on more than about 1% of the
tokens, `twell_jax.hot_feature_count`) count as dense GEMM columns at their cost; the dense
FFN's work in those units is every feature at that cost, `d_ff * BREAK_EVEN_RATE` (56 at
the paper's 5632). Real L1-trained layers hold 90-99% of their activity in a few hundred hot
features, so a layer with 60-100 active per token does the sparse work of 3-13.

With `update_from_counts`, each decision also picks every layer's number of hot features K
(a multiple of 256, with hysteresis: a new K is taken when it saves more than
`HOT_CHANGE_GAIN` of the dense FFN's work) and gives the popularity order of the features,
which the trainer applies to the parameters (`train.model.permute_ffn_features`) so that the
first K features are the hottest. Decisions run on the host, every `every` steps, from the
step metrics; a step is recompiled only when an implementation or a sparse layer's K changes
(a few times per run), and no conditional runs on the device. The reference implementation
switches at 50 active features per token every 20 forward calls.

The thresholds come from the kernel benchmarks (H100, paper shape, ratio to dense against the
work fraction): forward + backward 0.46-0.57 at the captured layers (`benchmarks.captured`,
work 0.1-0.3 of dense with their hot features), 0.74-0.76 on the uniform input of 30 active
per token (0.53), 1.21 at a captured layer run without hot features (1.6). Training goes
sparse below 0.6 of the dense work and back above 0.75; the inference forward gains less
per entry (0.60 captured, 0.85 uniform: it has no backward to save), so `for_inference`
goes sparse below 0.5.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time

from absl import logging

import numpy as np

from twell_jax import features as features_lib

# Fractions of the dense FFN's work (module docstring).
DEFAULT_SPARSE_BELOW = 0.6
DEFAULT_DENSE_ABOVE = 0.75
INFERENCE_SPARSE_BELOW = 0.5
# A new number of hot features is taken when it cuts the modelled work by more than this
# fraction of the dense FFN's: a smaller gain is not worth a recompiled step.
HOT_CHANGE_GAIN = 0.05


@dataclasses.dataclass
class LayerChoice:
  """Per-layer FFN implementation and hot features with hysteresis (module docstring)."""
  n_layers: int
  d_ff: int
  sparse: str = "mosaic_gpu"
  dense: str = "dense"
  sparse_below: float = DEFAULT_SPARSE_BELOW
  dense_above: float = DEFAULT_DENSE_ABOVE
  current: list[str] | None = None
  hot: list[int] | None = None

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

  @classmethod
  def for_inference(cls, work, d_ff: int, sparse: str = "mosaic_gpu") -> "LayerChoice":
    """The per-layer choice for a forward-only model with fixed weights from each layer's
    sparse work per token (`twell_jax.features.sparse_work`; the active features per token
    when its features are not sorted): sparse below `INFERENCE_SPARSE_BELOW` of the dense
    FFN's work (one decision, no hysteresis)."""
    work = np.asarray(work, np.float64).reshape(-1)
    choice = cls(work.shape[0], d_ff, sparse=sparse, sparse_below=INFERENCE_SPARSE_BELOW,
                 dense_above=INFERENCE_SPARSE_BELOW)
    choice.update(work)
    return choice

  @property
  def dense_work(self) -> float:
    """The dense FFN's work in `sparse_work`'s units: every feature at the break-even cost."""
    return self.d_ff * features_lib.BREAK_EVEN_RATE

  def update(self, work) -> bool:
    """Applies one decision from the layers' sparse work per token (`sparse_work`; without
    hot features, the active features per token); True if any layer changed."""
    work = np.asarray(work, np.float64).reshape(-1)
    if work.shape[0] != self.n_layers:
      raise ValueError(f"got {work.shape[0]} layers' activity for {self.n_layers} layers")
    new = list(self.current)
    for l, a in enumerate(work / self.dense_work):
      if new[l] == self.dense and a < self.sparse_below:
        new[l] = self.sparse
      elif new[l] == self.sparse and a > self.dense_above:
        new[l] = self.dense
    changed = new != self.current
    self.current = new
    return changed

  def update_from_counts(self, feature_counts, tokens: int):
    """One decision from each layer's feature counts [L, H] over `tokens` tokens
    (`FFNStats.feature_counts`): the hot features per layer (with hysteresis), then the
    implementations from the work with them. Returns (changed, popularity order [L, H]: the
    permutation that sorts each layer's features hottest first)."""
    counts = np.asarray(feature_counts)
    if counts.shape[0] != self.n_layers:
      raise ValueError(f"got {counts.shape[0]} layers' counts for {self.n_layers} layers")
    if counts.shape[-1] != self.d_ff:
      raise ValueError(f"got counts of {counts.shape[-1]} features for d_ff={self.d_ff}")
    hot, work = list(self.hot), []
    for l, c in enumerate(counts):
      k = features_lib.hot_feature_count(c, tokens)
      if k != hot[l] and (features_lib.sparse_work(c, tokens, hot[l])
                          - features_lib.sparse_work(c, tokens, k)
                          > HOT_CHANGE_GAIN * self.dense_work):
        hot[l] = k
      # Every feature hot: the dense FFN is that computation without the sparse overhead.
      work.append(np.inf if hot[l] >= c.shape[0]
                  else features_lib.sparse_work(c, tokens, hot[l]))
    changed = hot != self.hot
    self.hot = hot
    changed = self.update(work) or changed
    return changed, np.asarray(features_lib.popularity_order(counts))

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
  the step running). Executables are kept, so switching back costs nothing.
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

  def __init__(self, build, background: bool = True, quick_first: bool = False):
    import concurrent.futures  # pylint: disable=import-outside-toplevel
    import threading  # pylint: disable=import-outside-toplevel
    self._build = build
    self._background = background
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
      if names not in self._done:
        logging.info("building the train step for %s in the background", names)
        autotune = not self._quick_first
        self._built(seq, names, self._timed_build(names, autotune), autotune)
      if names not in self._tuned and self._seq == seq and not self._closing:
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

  def request(self, names: tuple) -> None:
    """Asks for the step of `names` (built in the background unless built before)."""
    self._seq += 1
    if names in self._done:
      self._built(self._seq, names, self._done[names], names in self._tuned)
      if names in self._tuned or not self._background:
        return
    if self._background:
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
