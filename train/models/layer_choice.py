"""Per-layer choice of the FFN implementation and of its hot features while sparsity emerges.

From random initialisation a ReLU layer fires on about half of its features, where the
sparse kernels are slower than dense; L1 training brings it down over the first steps, at
different speeds per layer. `LayerChoice` keeps each layer on the dense FFN until its sparse
FFN's predicted time falls below `sparse_below` of the dense one's, and sends it back only
above `dense_above` in two decisions in a row, holding its K at the first (hysteresis: no
flapping around one threshold, and no round trip to dense or to a near-dense K for one window
of unusual batches, which a few batches with many heavy rows cause).

The prediction (`CostModel`) is linear in what the sparse kernels do: a fixed part (the gate
GEMM, which stays dense, and the packing), the hot features K computed as dense GEMM columns
(`twell_jax.hot_feature_count`), and the entries outside them, gathered per token:

    ratio = fixed + hot * K / H + tail * tail_entries_per_token / (H * BREAK_EVEN_RATE)

Its coefficients are fitted to the kernel benchmark at the paper shape (`benchmarks.kernels`:
all activity on K hot features with no tail, and uniform activity with K = 0); the fit and how
the captured layers land on it: docs/performance.md. At another shape the prediction is
scaled by the kernels' measured speed there relative to the paper shape (`shape_scale`), and
where the kernels measured slower than dense (`shape_loses`) no layer runs sparse; the
decider (`train.models.implementations`) sets both from `twell_jax.shape_costs` and the
registry.

With `update_from_counts`, each decision also picks every layer's K: a multiple of 256 that
minimizes the prediction (a hot column is worth `CostModel.break_even` of the tokens), with
hysteresis (a new K is taken when it improves the prediction by more than `HOT_CHANGE_GAIN`,
or when the K in use leaves long columns to the backward's column kernels:
`twell_jax.features.column_floor`), and gives the popularity order of the features, which the
trainer applies to the parameters (`train.models.transformer.permute_ffn_features`) so that
the first K features are the hottest. Decisions run on the host, every `every` steps, from the
counts summed since the last decision (`train.training.choice_steps`); a step is recompiled
only when an implementation or a sparse layer's K changes (a few times per run), and no
conditional runs on the device.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from twell_jax import features as features_lib


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
# Rows over the ELL width (`FFNStats.heavy_rows_by_hot`) run on the kernels' dense tail, at
# about the dense FFN's cost for those rows; the tail holds R = M / 8 rows in buckets of R/16,
# R/4 and R (`pallas_kernels.ffn_train_mgpu.tail_buckets`), and more heavy rows than R take
# the dense FFN after the kernels. A layer's heavy rows vary widely from batch to batch, so a
# K is judged by `HEAVY_MARGIN` times the heavy rows its decision saw.
TAIL_ROW_COST = 1.2
TAIL_BUCKETS = (0.0, 1 / 128, 1 / 32, 1 / 8)
HEAVY_MARGIN = 4.0
DENSE = "dense"   # the implementation of a layer the choice keeps dense
# Thresholds on the predicted ratio.
DEFAULT_SPARSE_BELOW = 0.9
DEFAULT_DENSE_ABOVE = 1.0
INFERENCE_SPARSE_BELOW = 0.9
# A new number of hot features is taken when it improves the predicted ratio by more than
# this: a smaller gain is not worth a recompiled step.
HOT_CHANGE_GAIN = 0.03
# The predicted saving, in steps of the dense model, below which a new choice is not built.
# A build beside training costs the loop little, but a choice in flight holds off the next
# decision until it lands (`choice_steps`), and a prediction is good to a few hundredths of the
# dense FFN's time: a choice must save clearly more than that. In steps, not seconds, so that
# whether a choice is built does not depend on how fast this machine is (the same decisions in
# every run of a seed).
BUILD_COST_STEPS = 20.0


def parse_ahead(spec: str) -> tuple[tuple[int, bool], ...]:
  """The steps `layer_choice.ahead` names, as (K, last layer dense too): comma-separated items
  "K" (the first layer dense, every other one sparse with K hot features) or "K:last" (the
  last layer dense too), K a positive multiple of 256; "" names none. Raises ValueError
  naming the item that is not one."""
  out = []
  for item in (s.strip() for s in str(spec).split(",")):
    if not item:
      continue
    k, _, tail = item.partition(":")
    if not k.strip().isdigit() or tail.strip() not in ("", "last"):
      raise ValueError(f"{item!r} is not K or K:last (K hot features, e.g. '256,1024:last')")
    k = int(k)
    if k <= 0 or k % features_lib.TILE_N:
      raise ValueError(f"{item!r}: K must be a positive multiple of {features_lib.TILE_N}")
    if (k, tail.strip() == "last") not in out:
      out.append((k, tail.strip() == "last"))
  return tuple(out)


def parse_hot_menu(spec: str) -> tuple[int, ...]:
  """The K values `layer_choice.hot_menu` allows, ascending: comma-separated positive
  multiples of 256 ("" allows every multiple). Raises ValueError naming the item that is not
  one."""
  out = set()
  for item in (s.strip() for s in str(spec).split(",")):
    if not item:
      continue
    if not item.isdigit() or int(item) <= 0 or int(item) % features_lib.TILE_N:
      raise ValueError(f"{item!r} is not a positive multiple of {features_lib.TILE_N}")
    out.add(int(item))
  return tuple(sorted(out))


def ahead_keys(spec: str, n_layers: int, d_ff: int, sparse: str) -> tuple[tuple, ...]:
  """The `key`s (implementations, hot features) of the steps `layer_choice.ahead` names
  (`parse_ahead`) for `n_layers` layers of width `d_ff`: the first layer dense (and the last
  with ":last"), the others on `sparse` with K hot features (none where d_ff is one tile: K
  only past it). A K that holds every feature is left out (that step is the dense one, with
  the sparse kernels' overhead); ":last" without a middle layer too."""
  keys = []
  for k, last in parse_ahead(spec):
    if d_ff <= features_lib.TILE_N:
      k = 0
    elif k >= d_ff:
      continue
    if n_layers == 1:
      dense_at = set()   # a one-layer model's step has its only layer sparse
    else:
      dense_at = {0, n_layers - 1} if last else {0}
      if len(dense_at) == n_layers:
        continue
    key = (tuple(DENSE if i in dense_at else sparse for i in range(n_layers)),
           tuple(0 if i in dense_at else k for i in range(n_layers)))
    if key not in keys:
      keys.append(key)
  return tuple(keys)


def _at(tail_work, k: int) -> float:
  """`features.tail_work`'s entry for K = k (the last, 0, past H)."""
  return float(tail_work[min(k, tail_work.shape[0] - 1)])


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
  sparse_implementation: str = "mosaic_gpu"
  sparse_below: float = DEFAULT_SPARSE_BELOW
  dense_above: float = DEFAULT_DENSE_ABOVE
  cost: CostModel = TRAINING_COST
  current: list[str] | None = None
  hot: list[int] | None = None
  # Per layer: sparse and predicted above `dense_above` at the last decision (a second such
  # decision sends it dense).
  over: list[bool] | None = None
  # The layers' shape: the sparse kernels' measured speed there over the paper shape's, where
  # the cost model was fitted, and whether they lose to dense there (then no layer runs
  # sparse). Set by `train.models.implementations`; the defaults are the paper shape's.
  shape_scale: float = 1.0
  shape_loses: bool = False
  # The K a layer may take (`parse_hot_menu`; empty: any multiple of 256): a K between two is
  # raised to the next; one above the last stays as it is. A step compiles one scan per run of
  # neighbouring layers with the same FFN and K (`ModelConfig.layer_groups`): a K rounded to
  # equal its neighbour's makes one run fewer and a shorter build.
  hot_menu: tuple[int, ...] = ()
  # Keep every feature with more than twice a fair share of a layer's entries among its hot
  # ones (`twell_jax.features.column_floor`); False: K from the cost model alone.
  column_floor: bool = True

  def __post_init__(self):
    if not 0 <= self.sparse_below <= self.dense_above:
      raise ValueError(f"need 0 <= sparse_below ({self.sparse_below}) <= dense_above "
                       f"({self.dense_above})")
    if self.d_ff <= 0:
      raise ValueError(f"d_ff must be positive; got {self.d_ff}")
    if self.current is None:
      self.current = [DENSE] * self.n_layers
    if self.hot is None:
      self.hot = [0] * self.n_layers
    if self.over is None:
      self.over = [False] * self.n_layers
    # The last update_from_counts: per layer, active features per token outside the hot
    # ones, and the predicted ratio.
    self.tail = None
    self.predicted = None

  def predict(self, hot_features, tail_per_token, heavy_fraction=0.0, expected=False):
    """The predicted ratio of a layer at this choice's shape (inf where the kernels lose):
    K hot features, the active features per token outside them and the fraction of the rows
    over the ELL width there (module docstring, `TAIL_ROW_COST`).

    By default pessimistic, as a new K is chosen: the heavy rows taken `HEAVY_MARGIN` times,
    and inf past the tail's capacity. `expected`: the time a step already built is expected to
    take on this activity, to compare built steps (`ChoiceSteps`' bridge): the heavy rows as
    counted, and past the capacity the dense branch after the kernels (their fixed part plus
    the dense FFN), finite."""
    if self.shape_loses:
      return np.full(np.shape(tail_per_token), np.inf)
    heavy = (1.0 if expected else HEAVY_MARGIN) * np.asarray(heavy_fraction, np.float64)
    buckets = np.asarray(TAIL_BUCKETS)
    tail_rows = buckets[np.minimum(np.searchsorted(buckets, heavy), len(buckets) - 1)]
    ratio = (self.cost.ratio(self.d_ff, hot_features, tail_per_token) * self.shape_scale
             + TAIL_ROW_COST * tail_rows)
    past = self.cost.fixed * self.shape_scale + 1.0 if expected else np.inf
    return np.where(heavy > buckets[-1], past, ratio)

  def _heavy(self, heavy_rows_by_hot, k: int, tokens: int) -> float:
    """The fraction of the rows over the ELL width with k hot features (0 without counts)."""
    if heavy_rows_by_hot is None:
      return 0.0
    t = k // features_lib.TILE_N
    return float(heavy_rows_by_hot[t]) / tokens if t < len(heavy_rows_by_hot) else 0.0

  @classmethod
  def for_inference(cls, tail_per_token, d_ff: int, hot_features=None,
                    sparse_implementation: str = "mosaic_gpu", shape_scale: float = 1.0,
                    shape_loses: bool = False) -> "LayerChoice":
    """The per-layer choice for a forward-only model with fixed weights: sparse where the
    forward's predicted ratio (`INFERENCE_COST`, scaled by `shape_scale`) is below
    `INFERENCE_SPARSE_BELOW` (one decision, no hysteresis). `tail_per_token` [L]: each
    layer's active features per token outside its `hot_features` [L] (default none: the
    active features per token)."""
    tail = np.asarray(tail_per_token, np.float64).reshape(-1)
    hot = np.zeros_like(tail) if hot_features is None else np.asarray(hot_features)
    choice = cls(tail.shape[0], d_ff, sparse_implementation=sparse_implementation,
                 sparse_below=INFERENCE_SPARSE_BELOW,
                 dense_above=INFERENCE_SPARSE_BELOW, cost=INFERENCE_COST,
                 shape_scale=shape_scale, shape_loses=shape_loses)
    choice.update(choice.predict(hot, tail))
    return choice

  def update(self, ratios) -> bool:
    """Applies one decision from the layers' predicted ratios (`predict`); True if any
    layer changed. A sparse layer goes dense at its second decision in a row above
    `dense_above` (module docstring)."""
    ratios = np.asarray(ratios, np.float64).reshape(-1)
    if ratios.shape[0] != self.n_layers:
      raise ValueError(f"got {ratios.shape[0]} layers' activity for {self.n_layers} layers")
    new, over = list(self.current), [False] * self.n_layers
    for l, r in enumerate(ratios):
      if new[l] == DENSE and r < self.sparse_below:
        new[l] = self.sparse_implementation
      elif new[l] == self.sparse_implementation and r > self.dense_above:
        if self.over[l]:
          new[l] = DENSE
        else:
          over[l] = True
    changed = new != self.current
    self.current, self.over = new, over
    return changed

  def update_from_counts(self, feature_counts, tokens: int, heavy_rows_by_hot=None):
    """One decision from each layer's feature counts [L, H] over `tokens` tokens
    (`FFNStats.feature_counts`) and its rows over the ELL width by K ([L, ceil(H / 256)],
    `FFNStats.heavy_rows_by_hot`; None: not counted): the hot features per layer (with
    hysteresis), then the implementations from the predicted ratios with them. Returns
    (changed, popularity order [L, H]: the permutation that sorts each layer's features
    hottest first)."""
    counts = np.asarray(feature_counts)
    if counts.shape[0] != self.n_layers:
      raise ValueError(f"got {counts.shape[0]} layers' counts for {self.n_layers} layers")
    if counts.shape[-1] != self.d_ff:
      raise ValueError(f"got counts of {counts.shape[-1]} features for d_ff={self.d_ff}")
    heavy = [None] * self.n_layers if heavy_rows_by_hot is None else np.asarray(
        heavy_rows_by_hot)

    hot, tails, ratios = list(self.hot), [], []
    for l, c in enumerate(counts):
      tail_at = features_lib.tail_work(c, tokens)     # one sort per layer for every K tried
      tail_of = lambda k, t=tail_at: _at(t, k)
      predict = lambda k, l=l, tail_of=tail_of: float(self.predict(
          k, tail_of(k), self._heavy(heavy[l], k, tokens)))
      # The K of the linear model (and the long columns, `hot_feature_count`), raised where
      # more hot features take heavy rows off the dense tail.
      # `backward` is what raises K to the long-column floor (off: the cost model's K alone).
      k = features_lib.hot_feature_count(c, tokens, break_even=self.cost.break_even,
                                         backward=self.column_floor)
      if heavy[l] is not None and np.any(heavy[l]):
        k = min(range(k, c.shape[0], features_lib.TILE_N), key=predict, default=k)
      k = next((m for m in self.hot_menu if m >= k), k)
      if k != hot[l] and not self.shape_loses:   # no K makes a losing shape win
        # A K under the long columns' floor is never kept, however the prediction compares:
        # a feature that fires on a large share of the tokens makes a long column for the
        # backward's column kernels, a cost the linear model does not see.
        if (predict(hot[l]) - predict(k) > HOT_CHANGE_GAIN
            or (self.column_floor and hot[l] < features_lib.column_floor(c, tokens))):
          hot[l] = k
      # Every feature hot: the dense FFN is that computation without the sparse overhead.
      ratio = lambda k, c=c, predict=predict: np.inf if k >= c.shape[0] else predict(k)
      if (self.current[l] == self.sparse_implementation and not self.over[l]
          and ratio(hot[l]) > self.dense_above):
        # A first decision over dense_above holds the layer as it runs, K included: a new
        # K for one window of unusual batches (a loss spike) is a build whose step runs
        # slower than both.
        hot[l] = self.hot[l]
      tails.append(tail_of(hot[l]))
      ratios.append(ratio(hot[l]))
    changed = hot != self.hot
    self.hot, self.tail, self.predicted = hot, tails, ratios
    changed = self.update(ratios) or changed
    return changed, np.asarray(features_lib.popularity_order(counts))

  def costs(self, key, feature_counts, tokens: int, heavy_rows_by_hot=None,
            expected: bool = False) -> np.ndarray:
    """Each layer's predicted FFN time over the dense FFN's at `key` ((implementations, hot
    features), `LayerChoice.key`) for the activity in `feature_counts` [L, H] (features in
    popularity order) and `heavy_rows_by_hot` [L, T] (or None): 1 on a dense layer.
    `expected`: `predict`'s expected time, not its pessimistic one."""
    out = []
    heavy = [None] * len(key[0]) if heavy_rows_by_hot is None else heavy_rows_by_hot
    for name, k, c, hv in zip(*key, np.asarray(feature_counts), heavy):
      if name != self.sparse_implementation:
        out.append(1.0)
      else:
        tail = _at(features_lib.tail_work(c, tokens), k)
        out.append(float(self.predict(k, tail, self._heavy(hv, k, tokens), expected)))
    return np.asarray(out)

  @property
  def implementations(self) -> tuple[str, ...]:
    return tuple(self.current)

  @property
  def hot_features(self) -> tuple[int, ...]:
    """Each layer's hot features (0 on dense layers, where they mean nothing)."""
    return tuple(k if name == self.sparse_implementation else 0
                 for name, k in zip(self.current, self.hot))

  @property
  def key(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(implementations, hot features): what a compiled step depends on."""
    return self.implementations, self.hot_features

  def describe(self, key=None) -> str:
    """'S' for a sparse layer (with its hot features, 'S512'), 'D' for a dense one, in layer
    order (of `key`, default the current choice), space-separated."""
    names, hot = key or self.key
    return " ".join(("S" + (str(k) if k else "")) if name == self.sparse_implementation else "D"
                    for name, k in zip(names, hot))
