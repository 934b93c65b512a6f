"""Hidden features ordered by popularity, hottest first: what `ffn(..., hot_features=K)` needs.

Permuting the hidden features of a feed-forward block (the columns of W_gate and W_up and the
rows of W_down, by one permutation) leaves its function unchanged. The sparse kernels compute
the first K features as dense GEMMs on the tensor cores and the others through row gathers.
A dense feature costs 2 M D multiply-adds in each of the up and down projections, whatever
its activity; a sparse one costs two D-long weight-row reads per token on which it fires. On
an H100 (bf16 GEMMs at ~800 TFLOP/s, random rows from L2 at ~7.9 TB/s) the two meet at a firing
rate of about 1% (`BREAK_EVEN_RATE`), whatever M and D.

Real L1-trained layers have tens to hundreds of features above that rate, holding 90-99% of
all active entries (`benchmarks/results/<device>/forward_profile.json`), so: count each
feature's firing on a batch (`FFNStats.feature_counts`), sort the features by it
(`sort_features`), and pass `hot_feature_count(counts, tokens)` as `hot_features`; or let
`calibrate` do the three on a calibration batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import ffn_mgpu
from pallas_kernels._common import TILE_N
from twell_jax import validation

__all__ = ["BREAK_EVEN_RATE", "PARALLEL_COLUMNS", "popularity_order", "permute_features", "sort_features",
           "hot_feature_count", "column_floor", "sparse_work", "tail_work", "calibrate",
           "DENSE_ROW_ENTRIES"]

# Firing rate at which a dense feature costs what a sparse one does (module docstring).
BREAK_EVEN_RATE = 0.01
# CTAs the column kernels run at once (an H100's 132 SMs, about 8 each): a feature with more
# than 2 / PARALLEL_COLUMNS of a call's entries is a long column (`column_floor`).
PARALLEL_COLUMNS = 1024


def popularity_order(feature_counts) -> jax.Array:
  """The permutation [..., H] int32 that puts features in decreasing order of their counts
  (ties keep their order): new feature i is old feature order[i]."""
  counts = jnp.asarray(feature_counts)
  return jnp.argsort(-counts.astype(jnp.int32), axis=-1, stable=True).astype(jnp.int32)


def permute_features(w_gate, w_up, w_down, order):
  """(w_gate, w_up, w_down) with their hidden features in `order` [..., H]: w_gate / w_up
  [..., D, H] by columns, w_down [..., H, D] by rows; leading axes (stacked layers) are
  batch axes of `order` too. Any weight may be None (and stays None). The FFN's function is
  unchanged."""
  cols = lambda w: None if w is None else jnp.take_along_axis(w, order[..., None, :], -1)
  rows = lambda w: None if w is None else jnp.take_along_axis(w, order[..., :, None], -2)
  return cols(w_gate), cols(w_up), rows(w_down)


def sort_features(w_gate, w_up, w_down, feature_counts):
  """(w_gate, w_up, w_down, order): the weights with their hidden features sorted hottest
  first by `feature_counts` [..., H] (`FFNStats.feature_counts`), and the order applied."""
  order = popularity_order(feature_counts)
  return (*permute_features(w_gate, w_up, w_down, order), order)


def _sorted_rates(feature_counts, tokens: int) -> np.ndarray:
  if tokens <= 0:
    raise ValueError(f"tokens must be positive; got {tokens}")
  return np.sort(np.asarray(feature_counts, np.float64).reshape(-1))[::-1] / tokens


def sparse_work(feature_counts, tokens: int, hot_features: int, *,
                break_even: float = BREAK_EVEN_RATE) -> float:
  """The sparse kernels' work per token, in features gathered per token, with the
  `hot_features` most popular features dense (each costs `break_even`): what decides between
  the sparse and the dense FFN (`train.models.layer_choice`). Without hot features it is the mean
  active features per token."""
  rates = _sorted_rates(feature_counts, tokens)
  return float(hot_features * break_even + np.sum(rates[hot_features:]))


def _suffix_sums(rates) -> np.ndarray:
  return np.concatenate([np.cumsum(rates[::-1])[::-1], [0.0]])   # [k] = sum(rates[k:])


def tail_work(feature_counts, tokens: int) -> np.ndarray:
  """[H + 1]: entry k is the active features per token outside the k most popular ones
  (`sparse_work` at K = k without the hot features' cost; k past H: 0), from one sort: a
  caller trying many K (`train.models.layer_choice`) sorts once, not once per K."""
  return _suffix_sums(_sorted_rates(feature_counts, tokens))


def hot_feature_count(feature_counts, tokens: int, *, break_even: float = BREAK_EVEN_RATE,
                      parallel_columns: int = PARALLEL_COLUMNS, multiple: int = TILE_N,
                      backward: bool = True) -> int:
  """The K (a multiple of `multiple`) for a call whose features are sorted hottest first
  (host-side; `feature_counts` [H] over `tokens` tokens): the K that minimizes `sparse_work`,
  raised, with `backward`, until every feature with more than twice a fair share of the
  entries is dense (a share: all entries over `parallel_columns`, or over H when H is
  smaller). With one CTA per column in the backward's weight-gradient kernels, features on
  17-25% of the tokens of a layer with 1.3 active per token made its forward + backward
  slower than dense. Those kernels cut long columns into pieces
  (`pallas_kernels.sparse_backward_mgpu.column_pieces`); the floor, not measured without since,
  still keeps such features dense. The inference forward walks rows, not
  columns: for calls that are never differentiated, `backward=False` gives its K (an H100
  layer with 1.2 active per token: forward 0.49 of dense at K = 0, 0.75 at the K = 256 that
  its long columns ask for)."""
  rates = _sorted_rates(feature_counts, tokens)
  h = rates.shape[0]
  tail = _suffix_sums(rates)
  best_k, best = 0, tail[0]
  for k in range(multiple, -(-h // multiple) * multiple + 1, multiple):
    cost = k * break_even + tail[min(k, h)]
    if cost < best:
      best_k, best = k, cost
  if not backward:
    return best_k
  return max(best_k, _column_floor(rates, tail, parallel_columns, multiple))


def _column_floor(rates, tail, parallel_columns: int, multiple: int) -> int:
  long_columns = int(np.sum(rates > 2 * tail[0] / min(parallel_columns, rates.shape[0])))
  return -(-long_columns // multiple) * multiple


def column_floor(feature_counts, tokens: int, *, parallel_columns: int = PARALLEL_COLUMNS,
                 multiple: int = TILE_N) -> int:
  """The smallest K (a multiple of `multiple`) that makes dense every feature with more than
  twice a fair share of the entries, for features sorted hottest first (the long columns of
  `hot_feature_count`)."""
  rates = _sorted_rates(feature_counts, tokens)
  return _column_floor(rates, _suffix_sums(rates), parallel_columns, multiple)


# Rows with more active features than this take the kernels' dense path whatever K is (the
# inference forward's ``max_row_entries``, which the training kernels' ELL width matches).
DENSE_ROW_ENTRIES = ffn_mgpu.ForwardConfig().max_row_entries


def calibrate(x, w_gate, w_up, w_down, *, break_even: float = BREAK_EVEN_RATE,
              dense_row_entries: int | None = DENSE_ROW_ENTRIES, backward: bool = True):
  """(w_gate, w_up, w_down, hot_features) for a batch x [..., D] (leading axes are tokens,
  as for `twell_jax.ffn`) that shows typical activity:
  the weights with their features sorted by how often they fire on x, and the K to pass as
  `ffn(..., hot_features=K)` (a host-side int; `backward=False`: the K of calls that are
  never differentiated, see `hot_feature_count`). One dense gate GEMM; run it once (on a
  calibration batch), not per call.

  Firings on rows with more than `dense_row_entries` active features are not counted (None:
  all are): the kernels compute such rows densely anyway, so they add nothing to a feature's
  sparse cost, while 1% of half-dense rows would lift every feature over the break-even rate.
  """
  if dense_row_entries is not None and dense_row_entries < 0:
    raise ValueError(f"dense_row_entries must be >= 0 or None; got {dense_row_entries}")
  # Floating operands of agreeing shapes: token ids and mismatched weights are named.
  d, _ = validation.ffn_shapes(x, w_gate, w_up, w_down)
  if x.size == 0:
    raise ValueError(f"x must hold at least one token to calibrate on; got shape "
                     f"{tuple(x.shape)}.")
  x = jnp.reshape(x, (-1, d))
  pre = jnp.dot(x, w_up if w_gate is None else w_gate, preferred_element_type=jnp.float32)
  active = pre > 0
  if dense_row_entries is not None:
    light = jnp.sum(active, axis=1) <= dense_row_entries
    active = active & light[:, None]
  counts = jnp.sum(active, axis=0, dtype=jnp.int32)
  w_gate, w_up, w_down, _ = sort_features(w_gate, w_up, w_down, counts)
  k = hot_feature_count(jax.device_get(counts), x.shape[0], break_even=break_even,
                        backward=backward)
  return w_gate, w_up, w_down, k
