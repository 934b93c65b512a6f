"""The "gather" implementation: the exact ReLU FFN for few rows (decoding), reading only the
weights of the features that fire.

At decode time an FFN call has one row per sequence (M <= 64) and the dense FFN is three
weight-streaming GEMVs: its time is reading W_gate, W_up and W_down once. With a ReLU gate
only the features that fire in some row contribute, so:

  1. g = x W_gate [M, H] (the whole gate matrix is read: it decides what fires);
  2. the union over the rows of the active features (g > 0), compacted into K indices, K
     the smallest of `BUCKETS` that holds them (`lax.switch`: the reads follow the count);
  3. u = x W_up[:, idx] and y = (relu(g[:, idx]) * u) W_down[idx, :]: K columns of W_up
     and K rows of W_down instead of H each.

More active features than the largest bucket, or a non-finite gate pre-activation (a
non-finite x, or W_gate entry it meets): the dense FFN. Unused slots of a bucket point at a
feature that fired nowhere and are masked to zero, so every branch computes the same function
as the dense ReLU FFN (`dense.dense_ffn`), up to the order of the f32 sums, for finite
weights: a non-finite entry of W_up or W_down in a feature that fires nowhere is not read
(the dense FFN would spread it as NaN; checking would read the weights this path skips).
Its gradient is plain autodiff (exact, not sparse-efficient): it is an inference path. The
statistics are the dense path's, from the gate's activity mask.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import reference
from twell_jax import stats as stats_lib

__all__ = ["BUCKETS", "gather_ffn"]

# Capacities of the union of active features, tried smallest first.
BUCKETS = (64, 256, 1024)


def gather_ffn(x, w_gate: Optional[jax.Array], w_up, w_down,
               buckets: Sequence[int] = BUCKETS):
  """(y [M, D] x.dtype, FFNStats) of the ReLU FFN on x [M, D] (module docstring)."""
  m, h = x.shape[0], w_up.shape[1]
  pre_w = w_up if w_gate is None else w_gate
  g = jnp.dot(x, pre_w)                                   # x.dtype, as the dense path
  active = g > 0
  fired = jnp.any(active, axis=0)                         # [H]
  count = jnp.sum(fired.astype(jnp.int32))
  caps = sorted(k for k in set(buckets) if 0 < k < h)
  relu = reference.ACTIVATIONS["relu"]   # the dense path's (its derivative at 0 included)
  # A feature that fired in no row: the filler of unused slots (any, when all fired: then
  # only the dense branch runs).
  idle = jnp.argmin(fired)

  def sparse(k):
    def branch():
      idx = jnp.nonzero(fired, size=k, fill_value=idle)[0]
      valid = jnp.arange(k) < count
      p = jnp.where(valid, relu(jnp.take(g, idx, axis=1)), 0)
      if w_gate is None:
        hk = p
      else:
        u = jnp.dot(x, reference.columns(w_up, idx, 1))
        hk = (p.astype(jnp.float32) * u.astype(jnp.float32)).astype(x.dtype)
      y = jnp.dot(hk, reference.columns(w_down, idx, 0))
      return y, jnp.sum(jnp.abs(hk.astype(jnp.float32)))
    return branch

  def dense():
    y, hid, _ = reference.dense_ffn(x, w_gate, w_up, w_down, "relu")
    return y, jnp.sum(jnp.abs(hid.astype(jnp.float32)))

  branches = [sparse(k) for k in caps] + [dense]
  which = jnp.searchsorted(jnp.asarray(caps, jnp.int32), count)   # first cap >= count
  which = jnp.where(jnp.all(jnp.isfinite(g)), which, len(caps))
  y, l1 = jax.lax.switch(which, branches)
  return y, stats_lib.stats_from_mask(active, l1 / max(m, 1))
