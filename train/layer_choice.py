"""Per-layer hot features while sparsity emerges: how much of each FFN runs densely.

From random initialisation a ReLU layer fires on about half of its features, where the
sparse kernels' gathers cost more than the dense GEMMs; L1 training brings it down over the
first hundreds of steps, at different speeds per layer, and the last layers of a model often
settle at hundreds of active features per token, most of them on a few hundred features.
The kernels compute a layer's first K hidden features as dense GEMMs (the "hot" features,
the most popular ones once the trainer sorts the features by how often they fire) and the
rest through their gathers: K = H is the dense FFN's work, K = 0 all gathers. K is a run-time
value (`twell_jax.ffn`'s run-time hot_features, one entry of the menu
`twell_jax.features.hot_choices(H)`): the train step is compiled once, and a change of a
layer's K lands on the very next step, the same way in every run.

`LayerChoice` picks each layer's K every `layer_choice.every` steps from the step's feature
counts: the menu entry that minimizes the predicted time of its FFN (`CostModel`), linear in
what the kernels do: a fixed part (the gate GEMM and the packing), the hot features as dense
GEMM columns, and the entries outside them, gathered per token:

    ratio = fixed + hot * K / H + tail * tail_entries_per_token / (H * BREAK_EVEN_RATE)

The coefficients are fitted to the kernel benchmark (`benchmarks.kernels`, H100, paper shape
M=16384, D=2048, H=5632, ratio to XLA dense in one process;
`benchmarks/results/h100/kernels_hot_block_*.json`): all activity on K = 1024, 2048
and 3328 features with no tail (`paper_16k_block<K>`: forward + backward 0.53, 0.75, 0.98;
forward 0.57, 0.80, 0.84) and 30.6 uniform entries per token with K = 0 (`paper_16k`: 0.73;
0.88). The run-time K adds to each hot column the gate product that the gate kernel, which
packs every tile, computes again, and the backward's recomputation of the hot gate and up
values (three of the nine products a dense column costs: `RUNTIME_HOT`). A new K is taken
when it improves the prediction by more than `HOT_CHANGE_GAIN` (no flapping between two
entries of nearly equal cost).

Candidates are the menu entries that hold every "long column" (`features.long_columns`: a
feature with over twice a fair share of the entries, which the backward's column kernels
would give to one CTA; measured: features on 17-25% of the tokens of a layer with 1.3 active
per token made its forward + backward slower than dense).

The coefficients hold at the paper shape. At another shape (D, H, M tokens per device) the
prediction is scaled by the kernels' measured speed there relative to the paper shape
(`twell_jax.shape_costs.shape_factor`); where the kernels measured slower than dense
(`twell_jax.shape_costs.sparse_loses`) the trainer runs the dense FFN and makes no choice.

Each decision also gives the popularity order of every layer's features, which the trainer
applies to the parameters and the optimizer state (`train.model.permute_ffn_features`) so
that the first K features are the hottest. The reference implementation switches each layer
between its kernel and the dense path at 50 active features per token every 20 forward calls.

For a forward-only model with fixed weights (`inference_implementations`) each layer runs the
sparse implementation or the dense FFN, a static choice per compiled program.
"""

from __future__ import annotations

import dataclasses

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
STATIC_TRAINING_COST = CostModel(fixed=0.33, hot=1.10, tail=0.74)   # forward + backward
INFERENCE_COST = CostModel(fixed=0.50, hot=0.64, tail=0.70)         # forward
# A run-time K's hot column: the static one's, plus the gate product computed again and the
# hot gate / up values recomputed in the backward (3 of a dense column's 9 products). Its
# fixed part: the static one's plus what layers captured from a run from initialisation
# measured above it at K = 256 and a few entries per token (0.58 against 0.42 predicted,
# H200, `benchmarks.activity_sweep`): the gate packing every tile, the menu's conditionals,
# the weight gradients passed through them.
RUNTIME_HOT = 1.0 + 3.0 / 9.0
TRAINING_COST = dataclasses.replace(STATIC_TRAINING_COST, fixed=0.45,
                                    hot=STATIC_TRAINING_COST.hot * RUNTIME_HOT)
# The menu's last entry, all of H, runs the dense FFN, its backward recomputing the hidden
# activations from x: 11 of a dense FFN's 9 products.
DENSE_RATIO = 11.0 / 9.0
# Rows on the kernels' dense tail cost what the dense FFN does on them, and a little more
# (gathered and scattered rows). The tail holds R = M / 8 rows in buckets of R/16, R/4 and R
# (`pallas_kernels.ffn_train_mgpu.tail_buckets`); more heavy rows than R take the dense FFN
# after the kernels (never chosen).
TAIL_ROW_COST = 1.2
TAIL_BUCKETS = (0.0, 1 / 128, 1 / 32, 1 / 8)
# A decision sees one step's batch, and the next batches' heavy rows vary: a layer of the
# paper shape trained from initialisation measured 50 to 250 active features per token from
# one batch to another (steps 1,500-2,500), its rows over the ELL width from 0 to 8,400
# (past the tail: the dense FFN after the kernels). K is chosen for this many times the
# heavy rows seen.
HEAVY_MARGIN = 4.0
# Threshold on the predicted ratio of a forward-only layer (`inference_implementations`).
INFERENCE_SPARSE_BELOW = 0.9
# A layer's K changes when the new one improves its predicted ratio by more than this.
HOT_CHANGE_GAIN = 0.02


@dataclasses.dataclass
class LayerChoice:
  """Each layer's run-time number of hot features in training (module docstring)."""
  n_layers: int
  d_ff: int
  cost: CostModel = TRAINING_COST
  # The K values the compiled step serves (default `twell_jax.features.hot_choices(d_ff)`).
  menu: tuple[int, ...] | None = None
  # Each layer's K (default: all of H, the dense FFN's work: where a layer starts from random
  # initialisation, at half of its features active).
  hot: list[int] | None = None
  # The layers' shape: D and the tokens of one FFN call (per device), for the mosaic_gpu
  # kernels' measured speed there. None: the paper shape, where the cost model was fitted (also
  # what to pass for the interpreter, which runs for correctness, not speed).
  d_model: int | None = None
  tokens: int | None = None

  def __post_init__(self):
    if self.d_ff <= 0:
      raise ValueError(f"d_ff must be positive; got {self.d_ff}")
    if self.n_layers <= 0:
      raise ValueError(f"n_layers must be positive; got {self.n_layers}")
    self.menu = tuple(self.menu or features_lib.hot_choices(self.d_ff))
    self.all_hot = self.menu[-1]
    if self.hot is None:
      self.hot = [self.all_hot] * self.n_layers
    self.hot = [self._on_menu(k) for k in self.hot]
    self.shape_scale = (1.0 if self.d_model is None else
                        shape_costs.shape_factor(self.d_model, self.d_ff, self.tokens))
    # The last decision's: per layer, the active features per token outside the hot ones,
    # and the predicted ratio.
    self.tail = None
    self.predicted = None

  def _on_menu(self, k: int) -> int:
    """The menu entry the kernels run for K = k: the smallest one >= k, else the largest."""
    return next((m for m in self.menu if m >= int(k)), self.all_hot)

  def predict(self, hot_features, tail_per_token, heavy_fraction=0.0):
    """The predicted ratio to the dense FFN of a layer at this choice's shape: K hot features,
    the active features per token outside them, and the fraction of the rows over the ELL
    width there (`FFNStats.heavy_rows_by_hot`); the menu's last entry, all of H, is the dense
    FFN (`DENSE_RATIO`)."""
    hot = np.asarray(hot_features)
    heavy = HEAVY_MARGIN * np.asarray(heavy_fraction, np.float64)
    buckets = np.asarray(TAIL_BUCKETS)
    bucket = buckets[np.minimum(np.searchsorted(buckets, heavy), len(buckets) - 1)]
    sparse = (self.cost.ratio(self.d_ff, hot, tail_per_token) * self.shape_scale
              + TAIL_ROW_COST * bucket)
    sparse = np.where(heavy > buckets[-1], np.inf, sparse)
    return np.where(hot >= self.all_hot, DENSE_RATIO, sparse)

  def update_from_counts(self, feature_counts, tokens: int, heavy_rows_by_hot=None):
    """One decision from each layer's feature counts [L, H] over `tokens` tokens
    (`FFNStats.feature_counts`) and rows over the ELL width by K ([L, ceil(H / 256)],
    `FFNStats.heavy_rows_by_hot`; None: none). Returns (changed, popularity order [L, H]:
    the permutation that sorts each layer's features hottest first, which the caller
    applies to the parameters before the next step)."""
    counts = np.asarray(feature_counts)
    if counts.ndim != 2 or counts.shape[0] != self.n_layers:
      raise ValueError(f"got counts of shape {counts.shape} for {self.n_layers} layers")
    if counts.shape[-1] != self.d_ff:
      raise ValueError(f"got counts of {counts.shape[-1]} features for d_ff={self.d_ff}")
    menu = np.asarray(self.menu)
    tiles = -(-self.d_ff // features_lib.TILE_N)
    if heavy_rows_by_hot is None:
      heavy_rows_by_hot = np.zeros((self.n_layers, tiles))
    heavy_rows_by_hot = np.asarray(heavy_rows_by_hot, np.float64)
    hot, tails, ratios = [], [], []
    for k_now, c, heavy in zip(self.hot, counts, heavy_rows_by_hot):
      rates = np.sort(c.astype(np.float64))[::-1] / tokens
      tail_of = np.concatenate([np.cumsum(rates[::-1])[::-1], [0.0]])   # [k]: sum(rates[k:])
      tail = tail_of[np.minimum(menu, self.d_ff)]
      over = np.concatenate([heavy, [0.0]])[np.minimum(menu // features_lib.TILE_N, tiles)]
      pred = self.predict(menu, tail, over / tokens)
      # The backward's column kernels want every long column hot (`features.long_columns`).
      pred = np.where(menu >= features_lib.long_columns(c, tokens), pred, np.inf)
      best = int(np.argmin(pred))
      now = int(np.searchsorted(menu, k_now))
      pick = best if pred[now] - pred[best] > HOT_CHANGE_GAIN else now
      hot.append(int(menu[pick]))
      tails.append(float(tail[pick]))
      ratios.append(float(pred[pick]))
    changed = hot != self.hot
    self.hot, self.tail, self.predicted = hot, tails, ratios
    return changed, np.asarray(features_lib.popularity_order(counts))

  @property
  def hot_features(self) -> tuple[int, ...]:
    """Each layer's K (what the train step takes, as int32 [L])."""
    return tuple(self.hot)

  @property
  def sparse_layers(self) -> int:
    """Layers that gather some features (K below all of H)."""
    return sum(k < self.all_hot for k in self.hot)

  def describe(self, hot=None) -> str:
    """'S<K>' for a layer with K hot features ('S' for none), 'D' for all of them (the dense
    FFN's work), in layer order (of `hot`, default the current choice), space-separated."""
    return " ".join("D" if k >= self.all_hot else "S" + (str(k) if k else "")
                    for k in (self.hot if hot is None else hot))


def inference_implementations(tail_per_token, d_ff: int, hot_features=None,
                              sparse: str = "mosaic_gpu", d_model: int | None = None,
                              tokens: int | None = None) -> tuple[str, ...]:
  """The per-layer implementations of a forward-only model with fixed weights: `sparse`
  where the forward's predicted ratio (`INFERENCE_COST`, at the shape d_model x d_ff with
  `tokens` per call; None: the paper shape) is below `INFERENCE_SPARSE_BELOW`, else "dense".
  `tail_per_token` [L]: each layer's active features per token outside its `hot_features`
  [L] (default none: the active features per token)."""
  tail = np.asarray(tail_per_token, np.float64).reshape(-1)
  hot = np.zeros_like(tail) if hot_features is None else np.asarray(hot_features)
  if d_model is not None and sparse == "mosaic_gpu":
    if shape_costs.sparse_loses(d_model, d_ff, tokens):
      return ("dense",) * tail.shape[0]
    scale = shape_costs.shape_factor(d_model, d_ff, tokens, "fwd")
  else:
    scale = 1.0
  ratios = INFERENCE_COST.ratio(d_ff, hot, tail) * scale
  return tuple(sparse if r < INFERENCE_SPARSE_BELOW else "dense" for r in ratios)


def describe_implementations(names, hot, dense: str = "dense") -> str:
  """'S<K>' for a layer on a sparse implementation with K hot features, 'D' for a dense one."""
  return " ".join("D" if name == dense else "S" + (str(k) if k else "")
                  for name, k in zip(names, hot))
