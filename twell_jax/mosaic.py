"""Glue between `twell_jax.ffn` and the Pallas Mosaic GPU kernels in `pallas_kernels`.

Inference (no differentiation): the kernels (gate GEMM with TwELL epilogue +
fused sparse up/down projection).
Training (under jax.grad / jax.vjp): until the training kernels land, the
custom VJP's forward rule is the "xla" sparse forward, which produces y and
the sparse residuals in one pass, and the backward is the "xla" sparse
backward. Running the kernels there too would only add a second gate GEMM,
since their packed output is not the residual layout the backward reads.
"""

from __future__ import annotations

import functools

import jax

from twell_jax import sparse_xla
from twell_jax import stats as stats_lib

_STAT_KEYS = ("l1", "nnz_per_token", "max_tile_nnz", "overflow_rows", "fired")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _mosaic_ffn(kernels, cfg, interpret, x, w_gate, w_up, w_down):
  y, st = kernels.ffn_forward(x, w_gate, w_up, w_down, interpret=interpret)
  return (y,) + tuple(st[k] for k in _STAT_KEYS)


def _fwd(kernels, cfg, interpret, x, w_gate, w_up, w_down):
  del kernels, interpret
  return sparse_xla._forward(cfg, x, w_gate, w_up, w_down)  # pylint: disable=protected-access


def _bwd(kernels, cfg, interpret, residuals, cotangents):
  del kernels, interpret
  return sparse_xla._backward(cfg, residuals, cotangents)  # pylint: disable=protected-access


_mosaic_ffn.defvjp(_fwd, _bwd)


def mosaic_ffn(kernels, x, w_gate, w_up, w_down, *, interpret, ell_width, tail_rows):
  """Runs the kernels' forward with the xla sparse VJP; returns (y, FFNStats)."""
  m, d = x.shape
  cfg = sparse_xla.make_config(m, d, w_up.shape[1], ell_width, tail_rows)
  y, *st = _mosaic_ffn(kernels, cfg, interpret, x, w_gate, w_up, w_down)
  return y, stats_lib.FFNStats(**dict(zip(_STAT_KEYS, st)))
