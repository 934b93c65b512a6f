"""The "mosaic_gpu" implementation: `twell_jax.ffn` on the Pallas Mosaic GPU kernels.

Without differentiation the custom VJP's primal runs: the inference forward
(`pallas_kernels.ffn_mgpu.ffn_forward`: gate GEMM with the TwELL epilogue, then the fused sparse
up / down projection). Under jax.grad / jax.vjp / jax.checkpoint its rules run the training
kernels (`pallas_kernels.ffn_train_mgpu`): the forward rule converts TwELL to the hybrid ELL +
dense-tail layout and saves only sparse residuals; the backward rule computes every gradient
with sparse kernels plus dense tails for heavy rows, and an on-device `lax.switch` to the dense
VJP when more than `tail_rows` rows are heavy. `stats.overflow_rows` counts the rows that left
the sparse kernels (TwELL tile overflow without differentiation; tile overflow or more than
`ell_width` actives when differentiated).
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from pallas_kernels import _common as common
from pallas_kernels import ffn_mgpu
from pallas_kernels import ffn_train_mgpu
from twell_jax import stats as stats_lib


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """The static part of one call (the custom VJP's nondiff argument)."""
  train: ffn_train_mgpu.HybridConfig
  forward: ffn_mgpu.ForwardConfig
  interpret: bool


def _per_example(fn):
  """`fn` that runs once per example under jax.vmap (a `lax.map` over the mapped axis).

  The kernels take one [M, D] problem, and each entry picks its path with a
  `lax.switch` on a device value; vmap would turn that switch into a select
  that runs every branch (refused outright for the interpreter's IO effects).
  The kernels' statistics are per call, so per-example results need one call
  per example; to batch tokens into one call, put the batch axes into x's
  leading axes instead.
  """
  return jax.custom_batching.sequential_vmap(fn)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ffn(cfg: MosaicConfig, x, w_gate, w_up, w_down):
  return _per_example(functools.partial(ffn_mgpu.ffn_forward, config=cfg.forward,
                                        interpret=cfg.interpret))(x, w_gate, w_up, w_down)


def _fwd(cfg: MosaicConfig, x, w_gate, w_up, w_down):
  return _per_example(functools.partial(ffn_train_mgpu.forward, cfg.train,
                                        interpret=cfg.interpret))(x, w_gate, w_up, w_down)


def _bwd(cfg: MosaicConfig, residuals, cotangents):
  return _per_example(functools.partial(ffn_train_mgpu.backward, cfg.train,
                                        interpret=cfg.interpret))(residuals, cotangents)


_ffn.defvjp(_fwd, _bwd)


def default_config(m: int, d: int, h: int, *, interpret: bool = False, ell_width: int = 128,
                   tail_rows=None, hot_features: int = 0) -> MosaicConfig:
  """The tuned configuration of a call on x [m, d] with h hidden features, the first
  ``hot_features`` of them computed as dense GEMMs."""
  return MosaicConfig(
      train=ffn_train_mgpu.hybrid_config(m, d, h, ell_width, tail_rows,
                                         hot_features=hot_features),
      forward=ffn_mgpu.ForwardConfig(hot_features=hot_features, max_row_entries=ell_width),
      interpret=bool(interpret))


def ffn_with_config(cfg: MosaicConfig, x, w_gate, w_up, w_down):
  """Runs the kernels on x [M, D] with an explicit configuration: (y, FFNStats)."""
  y, stats = _ffn(cfg, *common.vary_together(x, w_gate, w_up, w_down))
  return y, stats_lib.from_dict(stats)


def mosaic_ffn(x, w_gate, w_up, w_down, *, interpret: bool, ell_width: int, tail_rows,
               hot_features: int = 0):
  """Runs the kernels on x [M, D] (training kernels under differentiation): (y, FFNStats)."""
  m, d = x.shape
  cfg = default_config(m, d, w_up.shape[1], interpret=interpret, ell_width=ell_width,
                       tail_rows=tail_rows, hot_features=hot_features)
  return ffn_with_config(cfg, x, w_gate, w_up, w_down)
