"""The "decode" implementation: the exact ReLU FFN for few rows (decoding), reading W_gate and
only the W_up and W_down rows of the features that fire (`pallas_kernels.decode_ffn_triton`).

At a decode step an FFN call has one row per sequence (M <= 64) and the dense FFN streams its
three weight matrices: its time is reading them. The kernels read W_gate (it decides what
fires) and, of W_up^T and W_down, the rows of the features that fire in some row: at
paper-like activity a few percent of them.

The kernels want the weights feature-major (W_gate^T, W_up^T, W_down: [H, D] each, a
feature's weights one contiguous row). A decode loop prepares that layout once
(`DecodeWeights.of`, as `train.generate` does) and calls `decode_ffn_weights`;
`twell_jax.ffn(..., implementation="decode")` takes the usual layout and transposes W_gate
and W_up in every call (a full read and write of each), so it runs only when named.

The gradient is the dense FFN's (exact, not sparse-efficient): an inference path.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from pallas_kernels import decode_ffn_triton
from pallas_kernels import reference
from twell_jax import stats as stats_lib

__all__ = ["DecodeWeights", "decode_ffn", "decode_ffn_weights", "MAX_ROWS"]

MAX_ROWS = decode_ffn_triton.MAX_ROWS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeWeights:
  """One FFN's weights in the decode kernels' layout, feature-major [H, D] each: w_pre_t
  (W_gate^T, or W_up^T when non-gated), w_up_t (W_up^T; None when non-gated), w_down."""
  w_pre_t: jax.Array
  w_up_t: Optional[jax.Array]
  w_down: jax.Array

  @classmethod
  def of(cls, w_gate, w_up, w_down) -> "DecodeWeights":
    """The layout of the usual (w_gate [D, H] or None, w_up [D, H], w_down [H, D])."""
    t = lambda w: jnp.swapaxes(w, 0, 1)
    if w_gate is None:
      return cls(t(w_up), None, w_down)
    return cls(t(w_gate), t(w_up), w_down)


def decode_ffn_weights(x, weights: DecodeWeights, *, interpret: bool = False,
                       config: decode_ffn_triton.DecodeConfig = decode_ffn_triton.DecodeConfig(),
                       ell_width: int = stats_lib.DEFAULT_ELL_WIDTH):
  """(y [M, D] x.dtype, FFNStats) of the ReLU FFN on x [M, D], M <= MAX_ROWS (`ell_width`:
  the width `FFNStats.heavy_rows_by_hot` counts against)."""
  y, p, hid = decode_ffn_triton.decode_ffn(x, weights.w_pre_t, weights.w_up_t,
                                           weights.w_down, config=config, interpret=interpret)
  l1 = jnp.sum(jnp.abs(hid.astype(jnp.float32))) / x.shape[0]
  return y, stats_lib.stats_from_mask(p > 0, l1, ell_width=ell_width)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _ffn(x, w_gate, w_up, w_down, interpret, ell_width):
  return decode_ffn_weights(x, DecodeWeights.of(w_gate, w_up, w_down), interpret=interpret,
                            ell_width=ell_width)


def _ffn_fwd(x, w_gate, w_up, w_down, interpret, ell_width):
  return _ffn(x, w_gate, w_up, w_down, interpret, ell_width), (x, w_gate, w_up, w_down)


def _ffn_bwd(interpret, ell_width, res, cts):
  del interpret, ell_width
  dy, dstats = cts
  return reference.dense_ffn_l1_vjp(*res, dy, dstats.l1)


_ffn.defvjp(_ffn_fwd, _ffn_bwd)


def decode_ffn(x, w_gate, w_up, w_down, *, interpret: bool = False,
               ell_width: int = stats_lib.DEFAULT_ELL_WIDTH):
  """(y, FFNStats) of the ReLU FFN on x [M, D] in the usual weight layout (module docstring:
  W_up is transposed in every call)."""
  return _ffn(x, w_gate, w_up, w_down, interpret, ell_width)
