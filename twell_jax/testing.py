"""Synthetic FFN inputs with a controlled gate sparsity (tests, benchmarks, examples).

The gate pre-activation is g = x W_gate. To steer how many entries are
positive, the first input feature of x is the constant 1 and row 0 of W_gate
is a negative bias b = -t * sigma, with sigma the spread of the rest of the
product, so an ordinary row has P(g > 0) = P(N(0, 1) > t) = `active_fraction`.
Heavy rows scale the random part of x by a large factor (about half their
features fire); empty rows zero the random part (nothing fires).
"""

from __future__ import annotations

import math
import statistics

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ffn_inputs"]


def ffn_inputs(key, m: int, d: int, h: int, *, active_fraction: float = 0.05,
               heavy_fraction: float = 0.0, empty_fraction: float = 0.0, gated: bool = True,
               dtype=jnp.bfloat16):
  """Returns (x [m, d], w_gate [d, h] or None, w_up [d, h], w_down [h, d]) in `dtype`.

  active_fraction: target P(gate > 0) for ordinary rows (e.g. 0.005, 0.05).
  heavy_fraction / empty_fraction: fractions of rows (rounded up when > 0)
  that are heavy (~50% active) or all-zero (none active).
  """
  if d < 2:
    raise ValueError(f"d must be >= 2 (one input feature carries the bias); got {d}.")
  kx, kg, ku, kd, kp = jax.random.split(key, 5)
  t = statistics.NormalDist().inv_cdf(1.0 - active_fraction)
  x = jax.random.normal(kx, (m, d), jnp.float32)
  x = x.at[:, 0].set(1.0)
  scale = 1.0 / math.sqrt(d - 1)
  w_gate = jax.random.normal(kg, (d, h), jnp.float32) * scale
  w_gate = w_gate.at[0].set(-t)       # sigma of the random part is ~1 by construction
  rows = np.asarray(jax.random.permutation(kp, m))
  n_heavy = math.ceil(heavy_fraction * m) if heavy_fraction > 0 else 0
  n_empty = math.ceil(empty_fraction * m) if empty_fraction > 0 else 0
  heavy, empty = rows[:n_heavy], rows[n_heavy:n_heavy + n_empty]
  if n_heavy:
    x = x.at[heavy, 1:].multiply(max(8.0, 8.0 * t))
  if n_empty:
    x = x.at[empty, 1:].set(0.0)
  w_up = jax.random.normal(ku, (d, h), jnp.float32) * scale
  w_down = jax.random.normal(kd, (h, d), jnp.float32) / math.sqrt(max(1.0, active_fraction * h))
  if not gated:
    # Non-gated blocks take the relu of x W_up: the bias trick moves to W_up.
    w_up, w_gate = w_gate, None
  cast = lambda a: None if a is None else a.astype(dtype)
  return cast(x), cast(w_gate), cast(w_up), cast(w_down)
