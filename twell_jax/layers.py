"""Flax layers over `twell_jax.ffn`: the NNX `FeedForward` and its Linen wrapper."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from twell_jax import api as ffn_lib
from twell_jax import sharded
from twell_jax import validation

__all__ = ["FeedForward", "linen_feed_forward"]


class FeedForward(nnx.Module):
  """Transformer feed-forward block on `twell_jax.ffn` (sparse ReLU by default).

  y = h W_down with h = act(x W_gate) * (x W_up) (gated) or act(x W_up).

  Params (nnx.Param, stored in `param_dtype`, cast to `dtype` for compute):
  w_gate [d_model, d_ff] (gated only), w_up [d_model, d_ff], w_down [d_ff, d_model],
  all initialised N(0, init_std^2) (the paper uses 0.02).

  Call with `return_stats=True` to get `(y, FFNStats)`; add
  `l1_coeff * stats.l1` (averaged over layers) to the training loss.
  x [..., d_model] may have any floating dtype: it is cast to `dtype` (bfloat16 by
  default), and so is the output, whatever x's dtype; integer x (token ids) is refused. `hot_features` (K, a multiple of 256): the
  sparse kernels compute the first K features densely; with the features
  sorted by popularity (`twell_jax.sort_features`) those are the hottest.
  `ell_width`, `tail_rows`, `hot_features` and `interpret` are plain attributes
  (not parameters) and may be changed between calls. Under a mesh in context
  (`jax.set_mesh`, Explicit or Auto axes) with batch axes ("data", "fsdp") each device runs
  the FFN on its own tokens (`twell_jax.sharded`).
  """

  def __init__(self, d_model: int, d_ff: int, *, gated: bool = True, activation: str = "relu",
               implementation: Optional[str] = None, param_dtype=jnp.float32, dtype=jnp.bfloat16,
               init_std: float = 0.02, ell_width: int = 128, tail_rows: Optional[int] = None,
               hot_features: int = 0, interpret: bool = False, rngs: nnx.Rngs):
    # The checks `twell_jax.ffn` makes on every call, made once here so a bad layer
    # fails at construction.
    validation.static_int(d_model, "d_model", minimum=1)
    validation.static_int(d_ff, "d_ff", minimum=1)
    validation.implementation_choice(implementation, ffn_lib.IMPLEMENTATIONS)
    validation.activation_choice(activation, implementation, ffn_lib.SPARSE_IMPLEMENTATIONS)
    validation.static_int(ell_width, "ell_width", minimum=1)
    validation.static_int(tail_rows, "tail_rows", minimum=0, allow_none=True, none_means="M/8")
    validation.hot_features_value(hot_features)
    validation.flag(interpret, "interpret")
    init = jax.nn.initializers.normal(init_std)
    self.d_model, self.d_ff = d_model, d_ff
    self.gated, self.activation, self.implementation = gated, activation, implementation
    self.dtype, self.param_dtype = dtype, param_dtype
    self.ell_width, self.tail_rows, self.interpret = ell_width, tail_rows, interpret
    self.hot_features = hot_features
    self.w_gate = nnx.Param(init(rngs.params(), (d_model, d_ff), param_dtype)) if gated else None
    self.w_up = nnx.Param(init(rngs.params(), (d_model, d_ff), param_dtype))
    self.w_down = nnx.Param(init(rngs.params(), (d_ff, d_model), param_dtype))

  def __call__(self, x, *, return_stats: bool = False):
    validation.floating(x, "x")   # before the cast, which would turn token ids into floats
    cast = lambda w: None if w is None else jnp.asarray(w[...], self.dtype)
    return sharded.ffn(jnp.asarray(x, self.dtype), cast(self.w_gate), cast(self.w_up),
                       cast(self.w_down), activation=self.activation,
                       implementation=self.implementation, interpret=self.interpret,
                       return_stats=return_stats, ell_width=self.ell_width,
                       tail_rows=self.tail_rows, hot_features=self.hot_features)


def linen_feed_forward(d_model: int, d_ff: int, *, name: Optional[str] = None, **kwargs):
  """A Linen module wrapping `FeedForward` (via `flax.nnx.bridge.to_linen`).

  Use it inside a `flax.linen` model like any submodule:
    ffn = linen_feed_forward(512, 2048, name="mlp")
    y, stats = ffn(x, return_stats=True)
  Its params live in the Linen "params" collection under the NNX names
  (w_gate, w_up, w_down); `kwargs` are `FeedForward`'s keyword arguments
  (without rngs, which Linen's "params" RNG stream provides).
  """
  return nnx.bridge.to_linen(FeedForward, d_model, d_ff, name=name, **kwargs)
