"""The "mosaic_gpu" implementation: `twell_jax.ffn` on the Pallas Mosaic GPU kernels.

Without differentiation the custom VJP's primal runs: the inference forward
(`pallas_kernels.ffn_mgpu.ffn_forward`: gate GEMM with the TwELL epilogue, then the fused sparse
up / down projection). Under jax.grad / jax.vjp / jax.checkpoint its rules run the training
kernels (`pallas_kernels.ffn_train_mgpu`): the forward rule converts TwELL to the hybrid ELL +
dense-tail layout and saves only sparse residuals; the backward rule computes every gradient
with sparse kernels plus dense tails for heavy rows, and an on-device `lax.switch` to the dense
VJP when more than `tail_rows` rows are heavy. With a run-time number of hot features (a
device scalar and a static menu, `hot_choices`) both directions run the training kernels
(`ffn_train_mgpu`'s run-time K). `stats.overflow_rows` counts the rows that left
the sparse kernels (TwELL tile overflow without differentiation; tile overflow or more than
`ell_width` actives when differentiated).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

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
def _ffn(cfg: MosaicConfig, x, w_gate, w_up, w_down, hot):
  if cfg.train.runtime_hot:
    # The inference kernels take K as a static value; with a run-time K the training
    # forward runs (its residuals unused: XLA drops what only they need).
    return _fwd(cfg, x, w_gate, w_up, w_down, hot)[0]
  return _per_example(functools.partial(ffn_mgpu.ffn_forward, config=cfg.forward,
                                        interpret=cfg.interpret))(x, w_gate, w_up, w_down)


def _fwd(cfg: MosaicConfig, x, w_gate, w_up, w_down, hot):
  return _per_example(functools.partial(ffn_train_mgpu.forward, cfg.train,
                                        interpret=cfg.interpret))(x, w_gate, w_up, w_down, hot)


def _bwd(cfg: MosaicConfig, residuals, cotangents):
  grads = _per_example(functools.partial(ffn_train_mgpu.backward, cfg.train,
                                         interpret=cfg.interpret))(residuals, cotangents)
  return (*grads, None)   # the run-time K: an integer, no cotangent


_ffn.defvjp(_fwd, _bwd)


def default_config(m: int, d: int, h: int, *, interpret: bool = False, ell_width: int = 128,
                   tail_rows=None, hot_features: int = 0,
                   hot_choices: tuple[int, ...] = ()) -> MosaicConfig:
  """The tuned configuration of a call on x [m, d] with h hidden features, the first
  ``hot_features`` of them computed as dense GEMMs (with ``hot_choices``: a run-time number
  of them, one of that menu)."""
  return MosaicConfig(
      train=ffn_train_mgpu.hybrid_config(m, d, h, ell_width, tail_rows,
                                         hot_features=hot_features,
                                         hot_choices=tuple(hot_choices)),
      forward=ffn_mgpu.ForwardConfig(hot_features=hot_features, max_row_entries=ell_width),
      interpret=bool(interpret))


def ffn_with_config(cfg: MosaicConfig, x, w_gate, w_up, w_down, hot=None):
  """Runs the kernels on x [M, D] with an explicit configuration: (y, FFNStats). ``hot``: the
  run-time number of hot features (an int32 scalar) of a config with ``hot_choices``."""
  if cfg.train.runtime_hot != (hot is not None):
    raise ValueError("a run-time hot feature count goes with a config's hot_choices: got "
                     f"hot={hot!r} for hot_choices={cfg.train.hot_choices}")
  if hot is not None:
    hot = jnp.asarray(hot, jnp.int32)
  y, stats = _ffn(cfg, *common.vary_together(x, w_gate, w_up, w_down), hot)
  return y, stats_lib.from_dict(stats)


def mosaic_ffn(x, w_gate, w_up, w_down, *, interpret: bool, ell_width: int, tail_rows,
               hot_features: int = 0, hot_choices: tuple[int, ...] = (), hot=None):
  """Runs the kernels on x [M, D] (training kernels under differentiation): (y, FFNStats)."""
  m, d = x.shape
  cfg = default_config(m, d, w_up.shape[1], interpret=interpret, ell_width=ell_width,
                       tail_rows=tail_rows, hot_features=hot_features, hot_choices=hot_choices)
  return ffn_with_config(cfg, x, w_gate, w_up, w_down, hot)
