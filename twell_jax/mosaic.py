"""Glue between `twell_jax.ffn` and the Pallas Mosaic GPU kernels in `pallas_kernels`.

Inference (no differentiation): the forward kernels (gate GEMM with TwELL epilogue + fused
sparse up/down projection, `pallas_kernels.ffn_mgpu.ffn_forward`).
Training (under jax.grad / jax.vjp / jax.checkpoint): the custom VJP's rules are the training
kernels of `pallas_kernels.ffn_train_mgpu`: the forward rule runs the gate GEMM (TwELL epilogue),
converts to the hybrid ELL + dense-tail layout and runs the sampled up / sparse down kernel,
saving only sparse residuals; the backward rule runs the row kernel (dh, du, dg, dx) and the
column kernel (dW_gate, dW_up, dW_down over a sorted CSC of the pattern), with dense XLA tails
for heavy rows and an on-device `lax.cond` fallback to the dense VJP when more than `tail_rows`
rows are heavy. `stats.overflow_rows` counts the rows that left the sparse kernel path (TwELL
tile overflow for inference; tile overflow or more than `ell_width` actives when differentiated).
"""

from __future__ import annotations

import functools

import jax

from twell_jax import stats as stats_lib

_STAT_KEYS = ("l1", "nnz_per_token", "max_tile_nnz", "overflow_rows", "fired")


def _train():
  from pallas_kernels import ffn_train_mgpu  # pylint: disable=import-outside-toplevel
  return ffn_train_mgpu


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _mosaic_ffn(kernels, cfg, interpret, x, w_gate, w_up, w_down):
  y, st = kernels.ffn_forward(x, w_gate, w_up, w_down, interpret=interpret)
  return (y,) + tuple(st[k] for k in _STAT_KEYS)


def _fwd(kernels, cfg, interpret, x, w_gate, w_up, w_down):
  del kernels
  return _train().forward(cfg, x, w_gate, w_up, w_down, interpret=interpret)


def _bwd(kernels, cfg, interpret, residuals, cotangents):
  del kernels
  return _train().backward(cfg, residuals, cotangents, interpret=interpret)


_mosaic_ffn.defvjp(_fwd, _bwd)


def mosaic_ffn(kernels, x, w_gate, w_up, w_down, *, interpret, ell_width, tail_rows):
  """Runs the Mosaic GPU kernels (training kernels under differentiation); returns (y, FFNStats)."""
  m, d = x.shape
  cfg = _train().make_config(m, d, w_up.shape[1], ell_width, tail_rows)
  y, *st = _mosaic_ffn(kernels, cfg, interpret, x, w_gate, w_up, w_down)
  return y, stats_lib.FFNStats(**dict(zip(_STAT_KEYS, st)))
