"""Synthetic FFN inputs with a controlled gate activity (tests, benchmarks, examples).

The gate pre-activation is g = x W_gate. The first input feature of x is the
constant 1, so row 0 of W_gate is a per-feature bias: feature j gets the bias
-t_j and a random part of spread ~1, and an ordinary row fires it with
probability q_j = P(N(0, 1) > t_j).

Feature popularity (the columns), as real L1-trained layers show it:
  * `dead_fraction` of the features never fire (zero weights, bias -1);
  * the alive ones fire uniformly (`hottest=None`: every q_j equals
    active_per_token / alive), or with a Zipf-like popularity
    q_k = hottest * k^-s over the popularity rank k, s solved so that the
    q_k sum to the mean active count per token (the hottest feature fires on a
    `hottest` share of the tokens). Which column has which rank is random.
Row lengths (the tokens):
  * `row_spread` > 0 scales each row's random part by exp(row_spread * N(0, 1)):
    rows with a large scale fire more of everything (a heavy-tailed row length);
  * `heavy_fraction` of the rows fire about half of the alive features;
  * `empty_fraction` of the rows are all-zero (nothing fires).

`activity_stats` measures the statistics that describe a real layer (dead
fraction, share of the top 1% of features, hottest feature, row-length
percentiles) from an activity mask, so generated and captured activations can
be compared side by side.
"""

from __future__ import annotations

import math
import statistics

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ffn_inputs", "feature_rates", "activity_stats"]

_NORMAL = statistics.NormalDist()


def feature_rates(h: int, active_per_token: float, *, dead_fraction: float = 0.0,
                  hottest: float | None = None) -> np.ndarray:
  """Per-feature firing probabilities q [h] of an ordinary row, sorted hottest first.

  They sum to `active_per_token` (when the alive features can hold it).
  """
  alive = max(1, int(round((1.0 - dead_fraction) * h))) if active_per_token > 0 else 0
  q = np.zeros(h)
  if alive == 0:
    return q
  if hottest is None or hottest * alive <= active_per_token:
    q[:alive] = min(1.0, active_per_token / alive)
    return q
  ranks = np.arange(1, alive + 1, dtype=np.float64)
  lo, hi = 0.0, 8.0                    # bisection on the Zipf exponent s
  for _ in range(60):
    s = 0.5 * (lo + hi)
    if np.sum(hottest * ranks ** -s) > active_per_token:
      lo = s
    else:
      hi = s
  q[:alive] = np.minimum(hottest * ranks ** -hi, 1.0)
  return q


def ffn_inputs(key, m: int, d: int, h: int, *, active_fraction: float = 0.05,
               heavy_fraction: float = 0.0, empty_fraction: float = 0.0,
               dead_fraction: float = 0.0, hottest: float | None = None,
               row_spread: float = 0.0, gated: bool = True, dtype=jnp.bfloat16):
  """Returns (x [m, d], w_gate [d, h] or None, w_up [d, h], w_down [h, d]) in `dtype`.

  active_fraction: mean P(gate > 0) of an ordinary row over all h features
    (active features per token = active_fraction * h).
  dead_fraction, hottest: feature popularity (see the module docstring).
  row_spread: sigma of the per-row log-normal scale (0: equal rows).
  heavy_fraction / empty_fraction: fractions of rows (rounded up when > 0)
  that are heavy (~50% of the alive features active) or all-zero.
  Deterministic in `key`.
  """
  if d < 2:
    raise ValueError(f"d must be >= 2 (one input feature carries the bias); got {d}.")
  if not 0.0 <= active_fraction <= 1.0:
    raise ValueError(f"active_fraction must be in [0, 1]; got {active_fraction}.")
  kx, kg, ku, kd, kp, kc, ks = jax.random.split(key, 7)
  q = feature_rates(h, active_fraction * h, dead_fraction=dead_fraction, hottest=hottest)
  q = q[np.asarray(jax.random.permutation(kc, h))]            # ranks to random columns
  alive = q > 0
  t = np.array([_NORMAL.inv_cdf(1.0 - min(max(v, 1e-12), 1 - 1e-12)) if a else 1.0
                for v, a in zip(q, alive)], np.float32)
  x = jax.random.normal(kx, (m, d), jnp.float32)
  if row_spread > 0:
    x = x * jnp.exp(row_spread * jax.random.normal(ks, (m, 1), jnp.float32))
  x = x.at[:, 0].set(1.0)
  scale = 1.0 / math.sqrt(d - 1)
  w_gate = jax.random.normal(kg, (d, h), jnp.float32) * scale
  w_gate = jnp.where(jnp.asarray(alive)[None, :], w_gate, 0.0)
  w_gate = w_gate.at[0].set(-jnp.asarray(t))   # sigma of the random part is ~1 by construction
  rows = np.asarray(jax.random.permutation(kp, m))
  n_heavy = math.ceil(heavy_fraction * m) if heavy_fraction > 0 else 0
  n_empty = math.ceil(empty_fraction * m) if empty_fraction > 0 else 0
  heavy, empty = rows[:n_heavy], rows[n_heavy:n_heavy + n_empty]
  if n_heavy:
    t_max = float(np.max(np.abs(t[alive]))) if alive.any() else 1.0
    x = x.at[heavy, 1:].multiply(max(8.0, 8.0 * t_max))
  if n_empty:
    x = x.at[empty, :].set(0.0)
  w_up = jax.random.normal(ku, (d, h), jnp.float32) * scale
  w_down = jax.random.normal(kd, (h, d), jnp.float32) / math.sqrt(
      max(1.0, active_fraction * h))
  if not gated:
    # Non-gated blocks take the relu of x W_up: the bias trick moves to W_up.
    w_up, w_gate = w_gate, None
  cast = lambda a: None if a is None else a.astype(dtype)
  return cast(x), cast(w_gate), cast(w_up), cast(w_down)


def activity_stats(active) -> dict:
  """Statistics of a boolean activity mask [M, H] (host numpy), as reported for real layers.

  active_per_token, dead_fraction (features that fire on no token), alive_fraction,
  top1pct_share / top10pct_share (share of all actives carried by the most popular 1% / 10%
  of the features), hottest_fraction (share of tokens the most popular feature fires on),
  row_p50 / row_p99 / row_max (active features per token).
  """
  a = np.asarray(active, bool)
  m, h = a.shape
  per_feature = np.sort(a.sum(axis=0))[::-1]
  per_row = a.sum(axis=1)
  total = max(int(per_feature.sum()), 1)
  top = lambda frac: float(per_feature[:max(1, int(round(frac * h)))].sum() / total)
  return {
      "active_per_token": float(per_row.mean()),
      "dead_fraction": float(np.mean(per_feature == 0)),
      "alive_fraction": float(np.mean(per_feature > 0)),
      "top1pct_share": top(0.01),
      "top10pct_share": top(0.10),
      "hottest_fraction": float(per_feature[0] / m),
      "row_p50": float(np.percentile(per_row, 50)),
      "row_p99": float(np.percentile(per_row, 99)),
      "row_max": int(per_row.max()),
  }
