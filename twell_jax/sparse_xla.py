"""The "xla" implementation: the sparse FFN algorithm in plain JAX, with a sparse custom VJP.

Math (x [M, D]; Wg, Wu [D, H]; Wd [H, D]; gated block, non-gated drops Wg and
uses h = relu(x Wu)):
  g = x Wg                     the only dense product (gate GEMM)
  S = {(m, j): g_mj > 0}       the active pattern, in the hybrid layout:
                               rows with at most W actives in ELL form
                               ([M, W] columns, gate values), heavier rows
                               ("heavy") in a dense tail of static capacity R
  u = (x Wu) on S              sampled product (SDDMM): a row gather of Wu^T
  h = bf16(relu(g)) * u on S;  y = h Wd (SpMM: a row gather of Wd)
  l1 = sum |h| / M
Backward with dy and the cotangent c of l1 (everything restricted to S):
  dh = (dy Wd^T) on S + (c / M) sign(h)     (SDDMM)
  du = dh * p;  dg = dh * u
  dx = du Wu^T + dg Wg^T                    (SpMM, row gathers)
  dWu = x^T du;  dWg = x^T dg;  dWd = h^T dy (scatter-adds over the pattern)
Tail rows use small dense products on their R rows. Residuals are the ELL
arrays ([M, W] columns, gate and up values), the tail rows ([R, H]), x and the
weights: never a dense [M, H] tensor.

Exactness: when more than R rows are heavy, `lax.cond` switches the forward to
the dense FFN and the backward to the VJP of the dense FFN recomputed from x
(no host sync); `overflow_rows` reports the number of heavy rows. NaN and
infinities reach the outputs and gradients as in the dense FFN: NaN gates are
active entries, and non-finite weights, dy or L1 cotangent take the
dense branch.

Gathers are chunked over rows (`lax.map(batch_size=...)`) so that the
[rows, W, D] gathered weight block stays around 64 MB whatever M is.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import _common as common
from pallas_kernels import reference
from twell_jax import formats
from twell_jax import stats as stats_lib

__all__ = ["SparseConfig", "sparse_ffn"]

_F32 = jnp.float32
# Elements of one chunk's gathered [rows, W, D] block (f32: 64 MB).
_GATHER_CHUNK_ELEMENTS = 1 << 24


@dataclasses.dataclass(frozen=True)
class SparseConfig:
  """Static configuration of one sparse FFN call."""
  ell_width: int   # W, capped at H
  tail_rows: int   # R, capped at M
  row_chunk: int   # rows per gather chunk


def make_config(m: int, d: int, h: int, ell_width: int, tail_rows) -> SparseConfig:
  w = min(ell_width, h)
  r = formats.default_capacity(m) if tail_rows is None else min(tail_rows, m)
  chunk = max(1, min(m, _GATHER_CHUNK_ELEMENTS // (w * d)))
  return SparseConfig(ell_width=w, tail_rows=r, row_chunk=chunk)


# ----------------------------------------------------------------------------
# Sparse products on the ELL pattern (cols [M, W] index rows of an [H, D] table)
# ----------------------------------------------------------------------------

def _sddmm(vec, table, cols, chunk):
  """out[m, k] = vec[m] . table[cols[m, k]]  ->  [M, W] f32."""
  def row(args):
    v, c = args
    return jnp.dot(table[c], v, preferred_element_type=_F32)
  return jax.lax.map(row, (vec, cols), batch_size=chunk)


def _spmm(coef, table, cols, chunk):
  """out[m] = sum_k coef[m, k] * table[cols[m, k]]  ->  [M, D] f32."""
  def row(args):
    a, c = args
    return jnp.dot(a, table[c].astype(_F32), preferred_element_type=_F32)
  return jax.lax.map(row, (coef, cols), batch_size=chunk)


def _spmm_t(coef, vec, cols, num_out, chunk):
  """Transposed product: out[j] = sum_{m,k: cols[m,k]=j} coef[m, k] * vec[m]  ->  [H, D] f32.

  A scatter-add over the pattern, one chunk of rows at a time so the
  [chunk * W, D] update block stays bounded.
  """
  m, w = coef.shape
  d = vec.shape[1]
  blocks = math.ceil(m / chunk)
  pad = blocks * chunk - m

  def blocked(a):
    a = jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1))
    return a.reshape((blocks, chunk) + a.shape[1:])

  def body(acc, blk):
    a, v, c = blk
    update = (a[:, :, None] * v[:, None, :].astype(_F32)).reshape(chunk * w, d)
    return acc.at[c.reshape(-1)].add(update), None

  acc0 = common.zeros_varying_like((num_out, d), _F32, coef, vec, cols)
  acc, _ = jax.lax.scan(body, acc0,
                        (blocked(coef), blocked(vec), blocked(cols)))
  return acc


# ----------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------

def _pattern(g, cfg: SparseConfig):
  """Hybrid layout of the active pattern of g [M, H] (f32). A NaN gate is active (relu(NaN)
  is NaN in the dense FFN, and must reach the output): a row with a non-finite x has only
  non-finite gates and becomes a heavy row, computed densely."""
  m = g.shape[0]
  active = (g > 0) | jnp.isnan(g)
  row_nnz = jnp.sum(active, axis=-1, dtype=jnp.int32)
  heavy = row_nnz > cfg.ell_width
  cols = formats._first_k_nonzero(active, cfg.ell_width)  # pylint: disable=protected-access
  keep = (jnp.arange(cfg.ell_width) < row_nnz[:, None]) & ~heavy[:, None]
  cols = jnp.where(keep, cols, 0)
  (tail_index,) = jnp.nonzero(heavy, size=cfg.tail_rows, fill_value=m)
  return active, keep, cols, tail_index.astype(jnp.int32), jnp.sum(heavy, dtype=jnp.int32)


def _sparse_branch(x, w_gate, w_up, w_down, g, keep, cols, tail_index, cfg):
  """Sparse forward: returns (y f32 [M, D], l1, residuals)."""
  m, dt = x.shape[0], x.dtype
  gated = w_gate is not None
  p = jnp.where(keep, jnp.take_along_axis(g, cols, axis=-1), 0).astype(dt)      # [M, W]
  pt = jnp.maximum(common.take_rows(g, tail_index), 0).astype(dt)                           # [R, H]
  xt = common.take_rows(x, tail_index)
  if gated:
    u = jnp.where(keep, _sddmm(x, w_up.T, cols, cfg.row_chunk), 0).astype(dt)
    ut = jnp.dot(xt, w_up, preferred_element_type=_F32).astype(dt)
    h_ell = (p.astype(_F32) * u.astype(_F32)).astype(dt)
    h_tail = (pt.astype(_F32) * ut.astype(_F32)).astype(dt)
  else:
    u, ut = jnp.zeros((m, 0), dt), jnp.zeros((tail_index.shape[0], 0), dt)
    h_ell, h_tail = p, pt
  y = _spmm(h_ell, w_down, cols, cfg.row_chunk)
  y = y.at[tail_index].add(jnp.dot(h_tail, w_down, preferred_element_type=_F32), mode="drop")
  l1 = (jnp.sum(jnp.abs(h_ell.astype(_F32))) + jnp.sum(jnp.abs(h_tail.astype(_F32)))) / m
  return y, l1, (p, u, pt, ut)


def _dense_branch(x, w_gate, w_up, w_down):
  y, l1, _ = reference.dense_ffn_l1(x, w_gate, w_up, w_down)
  return y.astype(_F32), l1


def _forward(cfg, x, w_gate, w_up, w_down):
  dt = x.dtype
  gated = w_gate is not None
  g = jnp.dot(x, w_gate if gated else w_up, preferred_element_type=_F32)
  active, keep, cols, tail_index, heavy_rows = _pattern(g, cfg)
  # More heavy rows than the tail holds, or non-finite weights (which the dense FFN
  # spreads to every row through the zeros of h): the dense FFN.
  exceeded = (heavy_rows > cfg.tail_rows) | reference.any_nonfinite(w_gate, w_up, w_down)

  def sparse(_):
    return _sparse_branch(x, w_gate, w_up, w_down, g, keep, cols, tail_index, cfg)

  def dense(_):
    y, l1 = _dense_branch(x, w_gate, w_up, w_down)
    res_shapes = jax.eval_shape(sparse, None)[2]
    zeros = lambda s: common.zeros_varying_like(s.shape, s.dtype, x, w_gate, w_up, w_down)
    return y, l1, jax.tree.map(zeros, res_shapes)

  y, l1, (p, u, pt, ut) = jax.lax.cond(exceeded, dense, sparse, None)
  nnz, max_tile, counts, heavy_by_hot = stats_lib.tile_stats(active, cfg.ell_width)
  outputs = (y.astype(dt), l1, nnz, max_tile, heavy_rows, counts, heavy_by_hot)
  residuals = (x, w_gate, w_up, w_down, cols, p, u, tail_index, pt, ut, exceeded)
  return outputs, residuals


# ----------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------

def _sparse_backward(cfg, residuals, dy, dl1):
  x, w_gate, w_up, w_down, cols, p, u, tail_index, pt, ut, _ = residuals
  m, dt = x.shape[0], x.dtype
  n_hidden = w_up.shape[1]
  gated = w_gate is not None
  chunk = cfg.row_chunk
  l1_scale = dl1.astype(_F32) / m

  # ELL part.
  pf = p.astype(_F32)
  h_ell = (pf * u.astype(_F32)).astype(dt) if gated else p
  dh = _sddmm(dy, w_down, cols, chunk) + l1_scale * jnp.sign(h_ell.astype(_F32))
  dh = jnp.where(p > 0, dh, 0)          # restrict to the pattern (padding has p == 0)
  dg = dh * u.astype(_F32) if gated else dh
  w_in = w_gate if gated else w_up       # the weight of the relu'd product
  dx = _spmm(dg, w_in.T, cols, chunk)
  dw_in_t = _spmm_t(dg, x, cols, n_hidden, chunk)
  dw_down = _spmm_t(h_ell.astype(_F32), dy, cols, n_hidden, chunk)
  if gated:
    du = dh * pf
    dx = dx + _spmm(du, w_up.T, cols, chunk)
    dw_up_t = _spmm_t(du, x, cols, n_hidden, chunk)

  # Dense tail rows (heavy rows, at most R of them).
  xt, dyt = common.take_rows(x, tail_index), common.take_rows(dy, tail_index)
  ptf = pt.astype(_F32)
  h_tail = (ptf * ut.astype(_F32)).astype(dt) if gated else pt
  dht = jnp.dot(dyt, w_down.T, preferred_element_type=_F32)
  dht = jnp.where(pt > 0, dht + l1_scale * jnp.sign(h_tail.astype(_F32)), 0)
  dgt = (dht * ut.astype(_F32) if gated else dht).astype(dt)
  dxt = jnp.dot(dgt, w_in.T, preferred_element_type=_F32)
  dw_in = dw_in_t.T + jnp.dot(xt.T, dgt, preferred_element_type=_F32)
  dw_down = dw_down + jnp.dot(h_tail.T, dyt, preferred_element_type=_F32)
  if gated:
    dut = (dht * ptf).astype(dt)
    dxt = dxt + jnp.dot(dut, w_up.T, preferred_element_type=_F32)
    dw_up = dw_up_t.T + jnp.dot(xt.T, dut, preferred_element_type=_F32)
  dx = dx.at[tail_index].add(dxt, mode="drop")

  if gated:
    return (dx.astype(x.dtype), dw_in.astype(w_gate.dtype), dw_up.astype(w_up.dtype),
            dw_down.astype(w_down.dtype))
  return dx.astype(x.dtype), None, dw_in.astype(w_up.dtype), dw_down.astype(w_down.dtype)


def _backward(cfg, residuals, cotangents):
  dy, dl1 = cotangents[0], cotangents[1]   # statistics other than l1 have no gradient
  # Non-finite dy or L1 cotangent: the dense VJP spreads it through the zeros of h.
  exceeded = residuals[-1] | reference.any_nonfinite(dy, dl1)
  return jax.lax.cond(exceeded,
                      lambda: reference.dense_ffn_l1_vjp(*residuals[:4], dy, dl1),
                      lambda: _sparse_backward(cfg, residuals, dy, dl1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sparse_ffn(cfg, x, w_gate, w_up, w_down):
  return _forward(cfg, x, w_gate, w_up, w_down)[0]


_sparse_ffn.defvjp(_forward, _backward)


def sparse_ffn(x, w_gate, w_up, w_down, *, ell_width: int = 128, tail_rows=None):
  """Sparse ReLU FFN on x [M, D] (already validated). Returns (y [M, D], FFNStats)."""
  m, d = x.shape
  cfg = make_config(m, d, w_up.shape[1], ell_width, tail_rows)
  operands = common.vary_together(x, w_gate, w_up, w_down)   # see its docstring (shard_map)
  y, l1, nnz, max_tile, overflow, counts, heavy_by_hot = _sparse_ffn(cfg, *operands)
  return y, stats_lib.FFNStats(l1=l1, nnz_per_token=nnz, max_tile_nnz=max_tile,
                               overflow_rows=overflow, feature_counts=counts,
                               heavy_rows_by_hot=heavy_by_hot)
