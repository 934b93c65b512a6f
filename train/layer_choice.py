"""Per-layer choice of the FFN implementation and of its hot features while sparsity emerges.

From random initialisation a ReLU layer fires on about half of its features, where the
sparse kernels are slower than dense; L1 training brings it down over the first steps, at
different speeds per layer. `LayerChoice` keeps each layer on the dense FFN until the work its
sparse kernels would do falls below `sparse_below`, and sends it back only above
`dense_above` (hysteresis: no flapping around one threshold). The work is measured in
features gathered per token (`twell_jax.features.sparse_work`): the active features per
token, except that the layer's hot features (those that fire on more than about 1% of the
tokens, `twell_jax.hot_feature_count`) count as dense GEMM columns at their cost. Real
L1-trained layers hold 90-99% of their activity in a few hundred hot features, so a layer
with 60-100 active per token does the sparse work of 3-13.

With `update_from_counts`, each decision also picks every layer's number of hot features K
(a multiple of 256, with hysteresis: a new K is taken when it saves more than 10% of the
work) and gives the popularity order of the features, which the trainer applies to the
parameters (`train.model.permute_ffn_features`) so that the first K features are the hottest.
Decisions run on the host, every `every` steps, from the step metrics; a step is recompiled
only when an implementation or a K changes (a few times per run), and no conditional runs on
the device. The reference implementation switches at 50 active features per token every 20
forward calls.

The thresholds come from the captured-activation benchmark (`benchmarks.captured`, H100,
paper shape, per layer, over dense): the training kernels (forward + backward) win at every
captured layer (0.45-0.64 of dense with hot features, up to 100 active per token), so
training switches to sparse below a work of 90 features per token; the inference forward
gains less per entry (it has no backward to save), so `for_inference` uses 48.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from absl import logging

import numpy as np

from twell_jax import features as features_lib

DEFAULT_SPARSE_BELOW = 90.0
DEFAULT_DENSE_ABOVE = 110.0
INFERENCE_SPARSE_BELOW = 48.0
# A new number of hot features is taken when it cuts the modelled work by more than this.
HOT_CHANGE_GAIN = 0.1


@dataclasses.dataclass
class LayerChoice:
  """Per-layer FFN implementation and hot features with hysteresis (module docstring)."""
  n_layers: int
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
    if self.current is None:
      self.current = [self.dense] * self.n_layers
    if self.hot is None:
      self.hot = [0] * self.n_layers

  @classmethod
  def for_inference(cls, work, sparse: str = "mosaic_gpu") -> "LayerChoice":
    """The per-layer choice for a forward-only model with fixed weights from each layer's
    sparse work per token (`twell_jax.features.sparse_work`; the active features per token
    when its features are not sorted): sparse below `INFERENCE_SPARSE_BELOW` (one decision, no
    hysteresis)."""
    work = np.asarray(work, np.float64).reshape(-1)
    choice = cls(work.shape[0], sparse=sparse, sparse_below=INFERENCE_SPARSE_BELOW,
                 dense_above=INFERENCE_SPARSE_BELOW)
    choice.update(work)
    return choice

  def update(self, work) -> bool:
    """Applies one decision from the layers' sparse work per token (`sparse_work`; without
    hot features, the active features per token); True if any layer changed."""
    work = np.asarray(work, np.float64).reshape(-1)
    if work.shape[0] != self.n_layers:
      raise ValueError(f"got {work.shape[0]} layers' activity for {self.n_layers} layers")
    new = list(self.current)
    for l, a in enumerate(work):
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
    hot, work = list(self.hot), []
    for l, c in enumerate(counts):
      k = features_lib.hot_feature_count(c, tokens)
      if k != hot[l] and (features_lib.sparse_work(c, tokens, hot[l])
                          > (1 + HOT_CHANGE_GAIN) * features_lib.sparse_work(c, tokens, k)):
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

  A switch must not stall training: the new step compiles (tens of seconds at the paper's
  shape) while the current one keeps running, and `ready` hands over the newest requested
  step that is built (a request that arrives while another builds replaces the queued one;
  the one in flight is still handed over when done, being closer to the latest choice than
  the step running). Executables are kept, so switching back costs nothing.
  `background=False` builds in `request` (the switch lands on the decision step:
  reproducible).

  Lowering a Pallas kernel is Python work that holds the GIL; while a build runs the
  interpreter's switch interval is shortened, so that the training loop's dispatch is not
  kept waiting behind it (the device would idle).
  """

  _BUILD_SWITCH_INTERVAL_S = 2e-4

  def __init__(self, build, background: bool = True):
    import concurrent.futures  # pylint: disable=import-outside-toplevel
    import threading  # pylint: disable=import-outside-toplevel
    self._build = build
    self._background = background
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    self._lock = threading.Lock()
    self._done: dict[tuple, object] = {}
    self._seq = 0                    # requests so far
    self._newest_built = (0, None)   # (request number, names) of the newest built request
    self._handed = 0                 # request number handed over last
    self._queued = []
    self.last_build_s = None         # seconds the last background build took
    self.failures = []               # (names, exception) of background builds that failed

  def get_now(self, names: tuple):
    """The step for `names`, compiled in this thread if it is not built yet."""
    if names not in self._done:
      self._done[names] = self._build(names)
    return self._done[names]

  def _built(self, seq: int, names: tuple, step) -> None:
    with self._lock:
      self._done[names] = step
      if seq > self._newest_built[0]:
        self._newest_built = (seq, names)

  def _timed_build(self, names: tuple):
    t0 = time.perf_counter()
    step = self._build(names)
    self.last_build_s = time.perf_counter() - t0
    logging.info("built the train step for %s in %.1f s", names, self.last_build_s)
    return step

  def _build_in_background(self, seq: int, names: tuple) -> None:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, self._BUILD_SWITCH_INTERVAL_S))
    try:
      logging.info("building the train step for %s in the background", names)
      self._built(seq, names, self._timed_build(names))
    except Exception as e:  # pylint: disable=broad-except
      # Training goes on with the step it runs; the failure must not pass unseen (a
      # worker thread's exception is otherwise kept in its future, which nobody reads).
      self.failures.append((names, e))
      logging.exception("building the train step for %s failed (%s: %s); training goes on "
                        "with the current one", names, type(e).__name__, e)
    finally:
      sys.setswitchinterval(interval)

  def request(self, names: tuple) -> None:
    """Asks for the step of `names` (built in the background unless built before)."""
    self._seq += 1
    if names in self._done:
      self._built(self._seq, names, self._done[names])
    elif self._background:
      for future in self._queued:
        future.cancel()                # not started yet: superseded
      self._queued = [self._pool.submit(self._build_in_background, self._seq, names)]
    else:
      self._built(self._seq, names, self._timed_build(names))

  def ready(self):
    """(names, step) of the newest built request not handed over yet, else None."""
    with self._lock:
      seq, names = self._newest_built
      if seq <= self._handed:
        return None
      self._handed = seq
      return names, self._done[names]

  def close(self):
    for future in self._queued:
      future.cancel()
    self._pool.shutdown(wait=True)
