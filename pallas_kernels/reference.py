"""The feed-forward block in plain XLA: the kernels' dense path and their f32 reference.

    gated:      h = act(x @ w_gate) * (x @ w_up);   y = h @ w_down
    non-gated:  h = act(x @ w_up);                   y = h @ w_down
x [M, D], w_gate / w_up [D, H], w_down [H, D].

``dense_ffn`` computes it as a bf16 model is written: plain ``x.dtype`` products (each GEMM
accumulates in f32 and rounds its output to x.dtype), h rounded to x.dtype. Its VJP is then
made of x.dtype GEMMs on the tensor cores too. The kernels take this path, exactly, for rows
beyond their static capacities, and the library's dense implementation is this function.

``reference_ffn`` computes everything in f32 at HIGHEST precision: what the tests compare the
kernels against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = {
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "gelu": jax.nn.gelu,
}


def dense_ffn(x, w_gate, w_up, w_down, activation: str = "relu"):
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


def reference_ffn(x, w_gate, w_up, w_down, activation: str = "relu"):
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
