"""The "dense" implementation (plain XLA, the speed baseline) and the f32 reference.

Both are the kernels' own dense computation (`pallas_kernels.reference`), with the
statistics every implementation returns.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from pallas_kernels import reference
from twell_jax import stats as stats_lib

__all__ = ["ACTIVATIONS", "dense_ffn", "activity_mask", "reference_ffn"]

ACTIVATIONS = reference.ACTIVATIONS


def dense_ffn(x, w_gate: Optional[jax.Array], w_up, w_down, activation: str = "relu",
              ell_width: int = stats_lib.DEFAULT_ELL_WIDTH):
  """Dense FFN on x [M, D]: h = act(x Wg) * (x Wu) (or act(x Wu)); y = h Wd, in plain x.dtype
  products as a bf16 model is written (`pallas_kernels.reference.dense_ffn_l1`).
  Returns (y, FFNStats); `ell_width` is the ELL width its `heavy_rows_by_hot` counts against.
  """
  y, l1, active = reference.dense_ffn_l1(x, w_gate, w_up, w_down, activation)
  return y, stats_lib.stats_from_mask(active, l1, ell_width=ell_width)


def activity_mask(x, w_gate: Optional[jax.Array], w_up, activation: str = "relu"):
  """The activity pattern [M, H] bool of the FFN on x [M, D] (what `FFNStats` counts): relu's
  gate pre-activation > 0, h != 0 for the other activations; the dense path's own numerics."""
  w_down = jnp.zeros((w_up.shape[1], x.shape[1]), x.dtype)  # y is not needed: XLA drops it
  return reference.dense_ffn_hidden(x, w_gate, w_up, w_down, activation)[2]


def reference_ffn(x, w_gate, w_up, w_down, activation: str = "relu"):
  """f32 reference: everything in float32 at HIGHEST precision. Returns (y, l1).

  x [..., D]; y has x's leading shape and dtype float32. Differentiable with
  plain jax.grad; the tests compare every implementation against it.
  """
  y, h = reference.reference_ffn_hidden(x, w_gate, w_up, w_down, activation)
  tokens = max(1, h.size // h.shape[-1])
  return y, jnp.sum(jnp.abs(h)) / tokens
