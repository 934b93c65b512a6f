"""Synthetic FFN inputs with a controlled gate activity (tests, benchmarks, examples).

The gate pre-activation is g = x W_gate. Input feature 0 of x is the constant 1, so row 0 of
W_gate is a per-feature bias -t_j; input feature 1 is a per-row offset that every alive
feature reads with weight 1 (zero except on heavy rows); the other d - 2 input features are
Gaussian and every alive gate column's part there has unit norm, so the random part of g is
N(0, 1) over the rows. Dead features read only the bias.

Feature popularity (the columns) is the firing probability q_k of an ordinary row by
popularity rank k (which column has which rank is random):
  * `dead_fraction` of the features never fire (zero weights, bias -1);
  * `hottest=None`: the alive features fire uniformly (every q_k is the mean activity over
    the alive features);
  * `hottest` alone: a Zipf curve q_k = hottest * k^-s over all alive features, s solved so
    that the q_k sum to the mean active count per token;
  * `hottest` and `top_shares`: a hot head and a cold tail, the shape of L1-trained layers.
    The head is a Zipf curve with an exponential cutoff, q_k = hottest * k^-s * exp(-(k-1)/K),
    over the ranks up to the second anchor of `top_shares`; s and K are solved so that the
    most popular features carry the given shares of all firings (one anchor: K infinite).
    Each further anchor adds a warm segment up to its rank, decaying geometrically from the
    rate before it to carry its share. The alive features past the last anchor share the
    rest of the firings equally (the cold tail, which no head rate falls below).
    Captured layers are matched by their top-1%, top-10% and top-50% shares,
    `((0.01, s1), (0.1, s10), (0.5, s50))`.
The thresholds t_j are solved so that each feature's firing rate over the ordinary rows is
q_j whatever the row spread.

Row lengths (the tokens):
  * `row_spread` > 0 scales each ordinary row's random part by exp(row_spread * N(0, 1)):
    rows with a large scale fire more of the cold features (a heavy-tailed row length);
  * `heavy_fraction` of the rows fire each alive feature with probability `heavy_fill`
    (near-dense rows at a fill close to 1; a random half of the alive features by default):
    such a row has no bias input and an offset at the heavy_fill quantile;
  * `empty_fraction` of the rows are all-zero (nothing fires).

`activity_stats` measures the statistics that describe a real layer (dead fraction, shares of
the most popular features, hottest feature, row-length percentiles) from an activity mask, so
generated and captured activations can be compared side by side.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from scipy import special

__all__ = ["ffn_inputs", "feature_rates", "gate_thresholds", "activity_stats"]

# Probabilists' Gauss-Hermite rule: expectations over the log-normal row scale.
_GH_NODES, _GH_WEIGHTS = np.polynomial.hermite_e.hermegauss(32)
_GH_WEIGHTS = _GH_WEIGHTS / _GH_WEIGHTS.sum()


def _alive_count(h: int, active_per_token: float, dead_fraction: float) -> int:
  if active_per_token <= 0:
    return 0
  return max(1, int(round((1.0 - dead_fraction) * h)))


def _head(hottest: float, n: int, s: float, inv_k: float) -> np.ndarray:
  k = np.arange(1, n + 1, dtype=np.float64)
  return hottest * k ** -s * np.exp(-inv_k * (k - 1))


def _bisect(f, lo: float, hi: float, iters: int = 60) -> float:
  """The root of a decreasing f on [lo, hi] (an end when f keeps one sign there)."""
  for _ in range(iters):
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if f(mid) > 0 else (lo, mid)
  return 0.5 * (lo + hi)


def _head_shape(hottest: float, anchors: list[tuple[int, float]]) -> tuple[float, float]:
  """(s, 1/K) of the head whose top anchors[i][0] ranks carry anchors[i][1] firings in all."""
  (n1, mass1) = anchors[0]

  def exponent(inv_k):
    if _head(hottest, n1, 0.0, inv_k).sum() <= mass1:
      return 0.0
    return _bisect(lambda s: _head(hottest, n1, s, inv_k).sum() - mass1, 0.0, 64.0)

  if len(anchors) == 1:
    return exponent(0.0), 0.0
  (n2, mass2) = anchors[1]
  beyond = lambda inv_k: _head(hottest, n2, exponent(inv_k), inv_k)[n1:].sum() - (mass2 - mass1)
  if beyond(0.0) <= 0:
    return exponent(0.0), 0.0       # a plain Zipf curve already puts too little past n1
  # Past `most` the exponent is 0 and the head too light.
  most = 0.0
  if _head(hottest, n1, 0.0, 0.0).sum() > mass1:
    most = _bisect(lambda inv_k: _head(hottest, n1, 0.0, inv_k).sum() - mass1, 0.0, 1e3)
  if beyond(most) <= 0:
    inv_k = _bisect(beyond, 0.0, most)
    return exponent(inv_k), inv_k
  # No curve of the family carries both shares: keep the cumulative one, the head falls short.
  return 0.0, _bisect(lambda inv_k: _head(hottest, n2, 0.0, inv_k).sum() - mass2, most, 1e3)


def feature_rates(h: int, active_per_token: float, *, dead_fraction: float = 0.0,
                  hottest: float | None = None, top_shares=()) -> np.ndarray:
  """Per-feature firing probabilities q [h] of an ordinary row, sorted hottest first.

  They sum to `active_per_token` when the alive features can hold it. `top_shares`:
  (fraction of the h features, share of all firings) pairs, e.g. ((0.01, 0.42), (0.1, 0.96));
  needs `hottest` (see the module docstring).
  """
  alive = _alive_count(h, active_per_token, dead_fraction)
  q = np.zeros(h)
  if alive == 0:
    return q
  top_shares = tuple(top_shares or ())
  if top_shares and hottest is None:
    raise ValueError("top_shares needs hottest (the firing rate of the most popular feature).")
  if hottest is None or hottest * alive <= active_per_token:
    q[:alive] = min(1.0, active_per_token / alive)
    return q
  anchors = sorted((min(alive, max(1, int(round(f * h)))), s * active_per_token)
                   for f, s in top_shares)
  # An anchor that spans every alive feature says nothing more than the mean activity.
  anchors = [a for a in anchors if a[0] < alive] or [(alive, active_per_token)]
  n_head = anchors[min(1, len(anchors) - 1)][0]
  s, inv_k = _head_shape(min(hottest, 1.0), anchors[:2])
  head = _head(min(hottest, 1.0), n_head, s, inv_k)
  for n, mass in anchors[2:]:
    head = np.concatenate([head, _warm(head[-1], n - head.shape[0], mass - head.sum())])
  n_head = head.shape[0]
  q[:n_head] = head
  if alive > n_head:
    # The cold tail's rate c, which also lifts any head rate below it: the rates sum to the
    # mean activity.
    n_tail = alive - n_head
    short = lambda c: active_per_token - np.maximum(head, c).sum() - n_tail * c
    c = 0.0 if short(0.0) <= 0 else _bisect(short, 0.0, active_per_token / n_tail)
    q[:n_head] = np.maximum(head, c)
    q[n_head:alive] = c
  return np.sort(np.minimum(q, 1.0))[::-1]


def _warm(start: float, n: int, mass: float) -> np.ndarray:
  """The n ranks after a head whose last rate is `start`, carrying `mass` firings: a
  geometric decay start * r^j (j = 1..n) from it, or equal rates where even r = 1 carries
  too little."""
  if n <= 0:
    return np.zeros(0)
  if mass >= start * n:
    return np.full(n, max(mass, 0.0) / n)
  j = np.arange(1, n + 1, dtype=np.float64)
  r = 1.0 - _bisect(lambda one_minus_r: (start * (1.0 - one_minus_r) ** j).sum() - mass,
                    0.0, 1.0)
  return start * r ** j


def gate_thresholds(q, row_spread: float = 0.0) -> np.ndarray:
  """Biases t [len(q)] such that an ordinary row fires feature j with probability q_j.

  A row with scale s fires j when s * z > t_j (z ~ N(0, 1)); with `row_spread` > 0 the scale
  is log-normal and t_j solves E_s[P(z > t_j / s)] = q_j.
  """
  values, where = np.unique(np.clip(np.asarray(q, np.float64), 1e-12, 1 - 1e-12),
                            return_inverse=True)
  if row_spread <= 0:
    return -special.ndtri(values)[where]
  scale = np.exp(row_spread * _GH_NODES)
  lo, hi = np.full_like(values, -1e3), np.full_like(values, 1e3)
  for _ in range(80):
    mid = 0.5 * (lo + hi)
    above = special.ndtr(-mid[:, None] / scale) @ _GH_WEIGHTS > values
    lo, hi = np.where(above, mid, lo), np.where(above, hi, mid)
  return (0.5 * (lo + hi))[where]


def ffn_inputs(key, m: int, d: int, h: int, *, active_fraction: float = 0.05,
               heavy_fraction: float = 0.0, heavy_fill: float = 0.5,
               empty_fraction: float = 0.0, dead_fraction: float = 0.0,
               hottest: float | None = None, top_shares=(), row_spread: float = 0.0,
               gated: bool = True, dtype=jnp.bfloat16):
  """Returns (x [m, d], w_gate [d, h] or None, w_up [d, h], w_down [h, d]) in `dtype`.

  active_fraction: mean P(gate > 0) of an ordinary row over all h features
    (active features per token = active_fraction * h).
  dead_fraction, hottest, top_shares: feature popularity (see the module docstring).
  row_spread: sigma of the per-row log-normal scale (0: equal rows).
  heavy_fraction / empty_fraction: fractions of rows (rounded up when > 0) that are heavy
    (each alive feature fires with probability `heavy_fill`) or all-zero.
  Deterministic in `key`.
  """
  if d < 3:
    raise ValueError(f"d must be >= 3 (input features 0 and 1 carry the bias and the row "
                     f"offset); got {d}.")
  if not 0.0 <= active_fraction <= 1.0:
    raise ValueError(f"active_fraction must be in [0, 1]; got {active_fraction}.")
  if not 0.0 <= heavy_fill <= 1.0:
    raise ValueError(f"heavy_fill must be in [0, 1]; got {heavy_fill}.")
  kx, kg, ku, kd, kp, kc, ks = jax.random.split(key, 7)
  active = active_fraction * h
  q = feature_rates(h, active, dead_fraction=dead_fraction, hottest=hottest,
                    top_shares=top_shares)
  rank = np.asarray(jax.random.permutation(kc, h))              # column -> popularity rank
  alive = rank < _alive_count(h, active, dead_fraction)
  t = np.ones(h)
  t[alive] = gate_thresholds(q[rank[alive]], row_spread)
  rows = np.asarray(jax.random.permutation(kp, m))
  n_heavy = math.ceil(heavy_fraction * m) if heavy_fraction > 0 else 0
  n_empty = math.ceil(empty_fraction * m) if empty_fraction > 0 else 0
  heavy, empty = rows[:n_heavy], rows[n_heavy:n_heavy + n_empty]
  # Per row: the bias input, the scale of the random part and the offset. A heavy row drops
  # the bias and gets unit-variance projections, so the offset alone sets its fill.
  bias, offset = np.ones(m, np.float32), np.zeros(m, np.float32)
  scale = np.ones(m, np.float32)
  if row_spread > 0:
    scale = np.exp(row_spread * np.asarray(jax.random.normal(ks, (m,), jnp.float32)))
  x = jax.random.normal(kx, (m, d), jnp.float32)
  if n_heavy:
    bias[heavy], scale[heavy] = 0.0, 1.0
    offset[heavy] = special.ndtri(min(max(heavy_fill, 1e-6), 1 - 1e-6))
    x = x.at[heavy, 2:].multiply(
        math.sqrt(d - 2) / jnp.linalg.norm(x[heavy, 2:], axis=1, keepdims=True))
  bias[empty], scale[empty] = 0.0, 0.0
  x = x * jnp.asarray(scale)[:, None]
  x = x.at[:, 0].set(jnp.asarray(bias)).at[:, 1].set(jnp.asarray(offset))
  w_rand = jax.random.normal(kg, (d - 2, h), jnp.float32)
  w_rand = w_rand / jnp.linalg.norm(w_rand, axis=0, keepdims=True)
  alive_j = jnp.asarray(alive)
  w_gate = jnp.concatenate([-jnp.asarray(t, jnp.float32)[None],
                            alive_j[None].astype(jnp.float32),
                            jnp.where(alive_j[None], w_rand, 0.0)])
  w_scale = 1.0 / math.sqrt(d - 1)
  w_up = jax.random.normal(ku, (d, h), jnp.float32) * w_scale
  w_down = jax.random.normal(kd, (h, d), jnp.float32) / math.sqrt(max(1.0, active))
  if not gated:
    # Non-gated blocks take the relu of x W_up: the bias trick moves to W_up.
    w_up, w_gate = w_gate, None
  cast = lambda a: None if a is None else a.astype(dtype)
  return cast(x), cast(w_gate), cast(w_up), cast(w_down)


def activity_stats(active) -> dict:
  """Statistics of a boolean activity mask [M, H] (host numpy), as reported for real layers.

  tokens (M), active_per_token, dead_fraction (features that fire on no token),
  alive_fraction, top1pct_share / top10pct_share / top50pct_share (share of all actives
  carried by the most popular 1% / 10% / 50% of the features), hottest_fraction (share of
  tokens the most popular feature fires on), row_p50 / row_p99 / row_max (active features per
  token).
  """
  a = np.asarray(active, bool)
  m, h = a.shape
  per_feature = np.sort(a.sum(axis=0))[::-1]
  per_row = a.sum(axis=1)
  total = max(int(per_feature.sum()), 1)
  top = lambda frac: float(per_feature[:max(1, int(round(frac * h)))].sum() / total)
  return {
      "tokens": m,
      "active_per_token": float(per_row.mean()),
      "dead_fraction": float(np.mean(per_feature == 0)),
      "alive_fraction": float(np.mean(per_feature > 0)),
      "top1pct_share": top(0.01),
      "top10pct_share": top(0.10),
      "top50pct_share": top(0.50),
      "hottest_fraction": float(per_feature[0] / m),
      "row_p50": float(np.percentile(per_row, 50)),
      "row_p99": float(np.percentile(per_row, 99)),
      "row_max": int(per_row.max()),
  }
