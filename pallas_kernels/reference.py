"""The feed-forward block in plain XLA: the kernels' dense path and their f32 reference.

    gated:      h = act(x @ w_gate) * (x @ w_up);   y = h @ w_down
    non-gated:  h = act(x @ w_up);                   y = h @ w_down
x [M, D], w_gate / w_up [D, H], w_down [H, D].

``dense_ffn_hidden`` computes it as a bf16 model is written: plain ``x.dtype`` products (each
GEMM accumulates in f32 and rounds its output to x.dtype), h rounded to x.dtype. Its VJP is
then made of x.dtype GEMMs on the tensor cores too (asking for f32 outputs and casting would
make the cotangents f32 and the backward's GEMMs f32 x bf16, far slower). ``dense_ffn_l1`` adds
the L1 term every implementation returns, and ``dense_ffn_l1_vjp`` is its VJP: the kernels take
this path, exactly, for rows beyond their static capacities, and the library's dense
implementation is this function.

``dense_ffn_columns`` is the same computation restricted to a subset of the hidden features
(the FFN is a sum over them): the kernels run a batch's most frequent features this way, as
small GEMMs on the tensor cores, and the rest through their gathers.

``reference_ffn_hidden`` computes everything in f32 at HIGHEST precision: what the tests compare
the kernels against.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp

ACTIVATIONS = {
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "gelu": jax.nn.gelu,
}


def dense_ffn_hidden(x, w_gate, w_up, w_down, activation: str = "relu"):
  """Returns (y [M, D] x.dtype, h [M, H] x.dtype, active [M, H] bool).

  ``active`` is the pattern the sparse paths use: relu's gate pre-activation > 0 (h != 0 for
  the other activations, which have no exact zeros). ``w_gate=None``: non-gated.
  """
  act = ACTIVATIONS[activation]
  pre = jnp.dot(x, w_up if w_gate is None else w_gate)
  h = act(pre) if w_gate is None else act(pre) * jnp.dot(x, w_up)
  h = h.astype(x.dtype)
  y = jnp.dot(h, w_down)
  active = pre > 0 if activation == "relu" else h != 0
  return y, h, active


def dense_ffn_l1(x, w_gate, w_up, w_down, activation: str = "relu"):
  """Returns (y [M, D] x.dtype, l1 f32, active [M, H] bool) of ``dense_ffn_hidden``: l1 = the
  sum of |h| over the features, averaged over the M tokens (the L1 term of every
  implementation)."""
  y, h, active = dense_ffn_hidden(x, w_gate, w_up, w_down, activation)
  return y, jnp.sum(jnp.abs(h.astype(jnp.float32))) / x.shape[0], active


def dense_ffn_l1_vjp(x, w_gate, w_up, w_down, dy, dl1, activation: str = "relu"):
  """(dx, dw_gate (None when w_gate is None), dw_up, dw_down) of ``dense_ffn_l1``'s (y, l1) for
  the cotangents dy [M, D] and dl1 (scalar), each in its operand's dtype: the backward of
  every path that falls back to the dense FFN."""
  primal = lambda *a: dense_ffn_l1(*a, activation)[:2]
  _, vjp = jax.vjp(primal, x, w_gate, w_up, w_down)
  return vjp((dy.astype(x.dtype), jnp.asarray(dl1, jnp.float32)))


def any_nonfinite(*arrays):
  """True when one of `arrays` (None entries skipped) holds a NaN or an infinity.

  The sparse paths take the dense path then, since the dense FFN spreads such a value: a
  non-finite weight reaches every output row (0 * inf = nan) and, backward, every row of dx;
  a non-finite dy or L1 cotangent every weight gradient. The arrays pass an optimization
  barrier first: XLA would otherwise constant-fold the reduction over arrays that are
  constants of the program (weights or a cotangent closed over by a jitted function), which
  takes minutes for [H, D] arrays. Arrays of one size share one reduction over their flat
  views (one pass over them all instead of a reduction kernel pair each; w_up [D, H] and
  w_down [H, D] are one).
  """
  groups = {}
  for a in arrays:
    if a is not None:
      groups.setdefault(a.size, []).append(a.reshape(-1))
  found = []
  for same in groups.values():
    same = lax.optimization_barrier(tuple(same))
    bad = functools.reduce(jnp.logical_or, [~jnp.isfinite(a) for a in same])
    found.append(jnp.any(bad))
  return functools.reduce(jnp.logical_or, found)


def columns(w, cols, axis: int):
  """``w``'s hidden features ``cols`` along ``axis``: an index array [K], or an int K for the
  first K (a slice, no gather)."""
  if isinstance(cols, int):
    return lax.slice_in_dim(w, 0, cols, axis=axis)
  return jnp.take(w, cols, axis=axis)


def column_weights(w_gate, w_up, cols):
  """[D, K] columns ``cols`` of the relu'd product's weight (w_gate, or w_up when non-gated),
  then those of w_up when gated: [D, 2K], so that one GEMM reads x once. ``cols``: indices
  [K] or an int K (the first K)."""
  parts = [columns(w_up if w_gate is None else w_gate, cols, 1)]
  if w_gate is not None:
    parts.append(columns(w_up, cols, 1))
  return jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]


def dense_ffn_columns(x, w_gate, w_up, w_down, cols, rows=None):
  """The relu FFN of ``dense_ffn`` restricted to the hidden features ``cols`` (indices [K], or
  an int K for the first K) and to the rows where ``rows`` [M] is True (the others get zeros;
  None: every row): (y [M, D], gu [M, 2K] = x [W_gate | W_up] as the GEMM wrote it ([M, K] of
  x W_up when non-gated), p [M, K], h [M, K]), all in x.dtype; p = relu(x W_gate)[:, cols]
  (of x W_up when non-gated) on ``rows``, h = p * u with u = (x W_up)[:, cols]. p and h follow
  from gu and ``rows`` (``columns_p_h``): a backward can keep gu alone."""
  k = cols if isinstance(cols, int) else cols.shape[0]
  gu = jnp.dot(x, column_weights(w_gate, w_up, cols))   # x.dtype out, as dense_ffn's GEMMs
  p, h = columns_p_h(gu, k, rows)
  return jnp.dot(h, columns(w_down, cols, 0)), gu, p, h


def columns_p_h(gu, k: int, rows=None):
  """(p, h) of ``dense_ffn_columns`` from its gu: p = relu(gate) on ``rows`` (zero elsewhere;
  None: every row), h = x.dtype(p * u) (h = p when non-gated: gu has k columns)."""
  p = jnp.maximum(gu[:, :k], 0)
  if rows is not None:
    p = jnp.where(rows[:, None], p, 0)
  if gu.shape[1] == k:
    return p, p
  return p, (p.astype(jnp.float32) * gu[:, k:].astype(jnp.float32)).astype(gu.dtype)


def reference_ffn_hidden(x, w_gate, w_up, w_down, activation: str = "relu"):
  """f32 reference at HIGHEST precision: (y [..., D] f32, h [..., H] f32); x [..., D]."""
  f32, hp = jnp.float32, jax.lax.Precision.HIGHEST
  act = ACTIVATIONS[activation]
  x = jnp.asarray(x, f32)
  up = jnp.matmul(x, jnp.asarray(w_up, f32), precision=hp)
  if w_gate is None:
    h = act(up)
  else:
    h = act(jnp.matmul(x, jnp.asarray(w_gate, f32), precision=hp)) * up
  return jnp.matmul(h, jnp.asarray(w_down, f32), precision=hp), h
